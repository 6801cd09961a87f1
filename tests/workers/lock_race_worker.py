"""`hf-concept train ARGS...` that starts on a signal, for the two-writers race in tests/test_train_lock.py.

The heavy imports happen first; the worker then prints "ready" and waits for the file named by
$HF_CONCEPT_RACE_GO to appear, so that two workers enter `train` within a millisecond of each other
(started as plain commands, their import times differ by more than a short run takes). Its exit
status is the command's.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

GO_ENV = "HF_CONCEPT_RACE_GO"

if __name__ == "__main__":
    from hf_concept import cli
    from hf_concept.training import recipes  # noqa: F401 (imports transformers' Trainer before the race)

    go = Path(os.environ[GO_ENV])
    print("ready", flush=True)
    deadline = time.monotonic() + 120
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.001)
    sys.exit(cli.main(["train", *sys.argv[1:]]))
