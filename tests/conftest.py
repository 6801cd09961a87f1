"""Shared pytest setup: deterministic, single-threaded-friendly torch settings for tiny models."""

import atexit
import os
import shutil
import tempfile

# Tests never reach the Hub; make any accidental attempt fail fast instead of hanging.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# `train --data` tokenizes through a cached `Dataset.map`: the suite's caches go to a folder of its own
# (set before anything imports `datasets`, which reads it once; subprocesses inherit it), removed at exit,
# never into the user's ~/.cache/huggingface/datasets.
_DATASETS_CACHE = tempfile.mkdtemp(prefix="hf-concept-tests-datasets-")
os.environ["HF_DATASETS_CACHE"] = _DATASETS_CACHE
atexit.register(shutil.rmtree, _DATASETS_CACHE, ignore_errors=True)
