"""Shared pytest setup: deterministic, single-threaded-friendly torch settings for tiny models."""

import atexit
import logging
import os
import shutil
import sys
import tempfile
import types
import warnings
from pathlib import Path

# Tests never reach the Hub; make any accidental attempt fail fast instead of hanging.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# `train --data` tokenizes through a cached `Dataset.map`: the suite's caches go to a folder of its own
# (set before anything imports `datasets`, which reads it once; subprocesses inherit it), removed at exit,
# never into the user's ~/.cache/huggingface/datasets.
_DATASETS_CACHE = tempfile.mkdtemp(prefix="hf-concept-tests-datasets-")
os.environ["HF_DATASETS_CACHE"] = _DATASETS_CACHE
atexit.register(shutil.rmtree, _DATASETS_CACHE, ignore_errors=True)

import torch  # noqa: E402
import transformers  # noqa: E402

# Deprecations that transformers announces against this project's own calls fail the suite, so that the next
# rename is seen the day a release announces it. A warning counts when transformers issues it (python
# warning or its logger) and the first caller outside transformers and torch is this project's code: the
# package, the tests, the benchmarks, or a checkpoint's copy of the remote code (`transformers_modules`).
# Third-party callers (PEFT, TRL) are their maintainers' to fix and pass through.
_ROOT = Path(__file__).resolve().parent.parent
_PROJECT_DIRS = tuple(str(_ROOT / name) + os.sep for name in ("src", "tests", "benchmarks", "examples"))
_LIBRARY_DIRS = tuple(str(Path(module.__file__).parent) + os.sep for module in (transformers, torch))
_DEPRECATIONS = (DeprecationWarning, FutureWarning)
# Frames where transformers calls itself through a method of ours: assisted decoding's candidate generator
# and the text-generation pipeline pass `generate` a generation config and loose arguments together, which
# transformers deprecates; the call is transformers' own, the project's `generate` only forwards it.
_TRANSFORMERS_CALLERS = (
    f"{os.sep}generation{os.sep}candidate_generator.py",
    f"{os.sep}pipelines{os.sep}text_generation.py",
)


def _project_caller(frame: types.FrameType | None) -> str | None:
    """`file:line` of the first frame outside transformers, torch and generated code, if it is the
    project's; None for anyone else's."""
    outer = frame
    while outer is not None:
        if outer.f_code.co_filename.endswith(_TRANSFORMERS_CALLERS):
            return None
        outer = outer.f_back
    while frame is not None:
        filename = frame.f_code.co_filename
        if not (filename.startswith(_LIBRARY_DIRS) or filename.startswith("<")):
            mine = filename.startswith(_PROJECT_DIRS) or f"{os.sep}transformers_modules{os.sep}" in filename
            return f"{filename}:{frame.f_lineno}" if mine else None
        frame = frame.f_back
    return None


class DeprecatedCallError(AssertionError):
    """transformers announced the deprecation of something this project calls."""


def _check_deprecation(message: object, frame: types.FrameType | None) -> None:
    if frame is None or not frame.f_code.co_filename.startswith(_LIBRARY_DIRS[0]):
        return
    caller = _project_caller(frame)
    if caller is not None:
        raise DeprecatedCallError(f"transformers deprecates a call at {caller}: {message}")


_original_warn = warnings.warn


def _guarded_warn(message, category=None, stacklevel=1, source=None):
    kind = type(message) if isinstance(message, Warning) else (category or UserWarning)
    if issubclass(kind, _DEPRECATIONS):
        _check_deprecation(message, sys._getframe(1))
    _original_warn(message, category, stacklevel + 1, source)


warnings.warn = _guarded_warn


class _DeprecationLogGuard(logging.Handler):
    """transformers' logged deprecations (e.g. the `past_key_values` alias of its outputs)."""

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING and "deprecated" in record.getMessage():
            # The frame that called the logger: the handler runs inside `Logger.handle`.
            frame = sys._getframe(1)
            while frame is not None and frame.f_code.co_filename != record.pathname:
                frame = frame.f_back
            _check_deprecation(record.getMessage(), frame)


logging.getLogger("transformers").addHandler(_DeprecationLogGuard())
