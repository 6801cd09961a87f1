"""Runs `hf-concept train` in a process that SIGKILLs itself at a chosen point (tests/test_train_kill.py).

$HF_CONCEPT_KILL_AT names the point: "save:N" dies while checkpoint-N is being written (its weights are
on disk, its optimizer state is not), "final" dies while the final model is being saved (after its weights
are written to the staging folder, before they are moved into place), "" runs to the end. Every training
step sleeps $HF_CONCEPT_STEP_SLEEP seconds, so that a kill from outside lands while training runs.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from transformers import Trainer, TrainerCallback

from hf_concept import cli
from hf_concept.training import output

KILL_AT_ENV = "HF_CONCEPT_KILL_AT"
STEP_SLEEP_ENV = "HF_CONCEPT_STEP_SLEEP"


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class SlowSteps(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(float(os.environ.get(STEP_SLEEP_ENV, "0")))


def _arm(point: str) -> None:
    if point.startswith("save:"):
        step = int(point.removeprefix("save:"))
        original = Trainer._save_optimizer_and_scheduler

        def save(self, output_dir):
            if self.state.global_step == step:
                _die()
            return original(self, output_dir)

        Trainer._save_optimizer_and_scheduler = save
    elif point == "final":
        output._write_card = lambda *args, **kwargs: _die()


if __name__ == "__main__":
    _arm(os.environ.get(KILL_AT_ENV, ""))
    sys.exit(cli.main(["train", *sys.argv[1:], "--callback", "tests.workers.kill_worker:SlowSteps"]))
