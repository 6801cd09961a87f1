"""Plain reference implementations used by tests and benchmarks."""
