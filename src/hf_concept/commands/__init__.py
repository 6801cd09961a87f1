"""Subcommands of the `hf-concept` CLI, one module each."""
