"""Load a script of benchmarks/ as a module, for the tests that keep the scripts from rotting."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """benchmarks/`name`.py executed afresh as module `name`, with benchmarks/ on sys.path (the scripts
    import their siblings) and the module in sys.modules before it runs (dataclasses look their module
    up there while the script executes)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
