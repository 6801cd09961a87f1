"""Shared pytest setup: deterministic, single-threaded-friendly torch settings for tiny models."""

import os

# Tests never reach the Hub; make any accidental attempt fail fast instead of hanging.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
