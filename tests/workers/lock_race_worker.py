"""`hf-concept train ARGS...` that starts on a signal, for the two-writers race in tests/test_train_lock.py.

The heavy imports happen first; the worker then prints "ready" and waits for the file named by
$HF_CONCEPT_RACE_GO to appear, so that two workers enter `train` within a millisecond of each other
(started as plain commands, their import times differ by more than a short run takes). Loading the
model is made to take $HF_CONCEPT_RACE_LOAD_S seconds, as a real checkpoint's load does: that is the
window in which a run that checked an empty folder has not yet written anything into it. Its exit
status is the command's.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

GO_ENV = "HF_CONCEPT_RACE_GO"
LOAD_ENV = "HF_CONCEPT_RACE_LOAD_S"


def _slow_load(load_model, seconds: float):
    def load(*args, **kwargs):
        time.sleep(seconds)
        return load_model(*args, **kwargs)

    return load


if __name__ == "__main__":
    from hf_concept import cli
    from hf_concept.training import recipes

    recipes.load_model = _slow_load(recipes.load_model, float(os.environ.get(LOAD_ENV, "0")))

    go = Path(os.environ[GO_ENV])
    print("ready", flush=True)
    deadline = time.monotonic() + 120
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.001)
    sys.exit(cli.main(["train", *sys.argv[1:]]))
