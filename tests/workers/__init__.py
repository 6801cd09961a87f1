"""Scripts that tests launch in child processes (torchrun workers)."""
