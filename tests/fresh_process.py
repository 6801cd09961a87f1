"""Run converted checkpoints in a fresh `python -I` process where `hf_concept` cannot be imported.

This is the user's situation after `from_pretrained(path, trust_remote_code=True)` on a machine without
our package: everything must come from the files next to the weights.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch

FRESH_PROCESS_LOGITS = """
import sys
sys.modules["hf_concept"] = None
import torch
from transformers import AutoModelForCausalLM
jobs, batch, class_name = torch.load(sys.argv[1])
logits = {}
for name, folder in jobs.items():
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    assert type(model).__name__ == class_name, type(model)
    with torch.no_grad():
        logits[name] = model(**batch).logits
torch.save(logits, sys.argv[2])
"""


def fresh_process_logits(
    tmp_path, jobs: dict[str, str], batch: dict, class_name: str
) -> dict[str, torch.Tensor]:
    """Logits of each checkpoint folder in `jobs` (name -> folder), each loaded as a `class_name`."""
    (tmp_path / "fresh.py").write_text(FRESH_PROCESS_LOGITS)
    torch.save((jobs, batch, class_name), tmp_path / "jobs.pt")
    environment = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-I", "fresh.py", "jobs.pt", "logits.pt"],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(tmp_path / "logits.pt")
