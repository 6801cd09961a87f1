"""Tiny saved checkpoints of every family, their greedy tokens in an isolated process, and folders that
carry an earlier version's remote code: shared by `test_upgrade.py` and `scripts/version_matrix.py`.

The isolated process is the user's situation on another machine: `python -I`, `hf_concept` blocked, the
model loaded with `AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# One configuration per family (tests/conformance/families.py).
CHECKPOINT_SPECS = ("plain", "conceptmoe-first", "dlcm", "hidden-decoding", "lslm")
PROMPT = [[5, 17, 9, 30, 12, 7, 21, 4]]
NEW_TOKENS = 12
# The last commit whose remote code passes `past_key_values` everywhere (before the compatibility layer):
# what a folder saved by hf_concept 0.1.0 before transformers 5.24 carries.
LEGACY_CODE_COMMIT = "e9e2d37"
LEGACY_CODE_DIR = "src/hf_concept/modeling"
# Config values newer than the legacy commits, as their code wrote them: the joint LSLM schedule
# (`update_schedule` 0) came later and older code refuses it. A training field: the greedy tokens compared
# do not depend on it.
OLDER_CONFIG_VALUES = {"update_schedule": (0, 1)}

GREEDY_SCRIPT = """
import json, sys
sys.modules["hf_concept"] = None
import torch
from transformers import AutoModelForCausalLM
folders, prompt, new_tokens = json.loads(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
tokens = {}
for name, folder in folders.items():
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        output = model.generate(torch.tensor(prompt), max_new_tokens=new_tokens, do_sample=False)
    tokens[name] = output[0].tolist()
print(json.dumps(tokens))
"""


def save_checkpoints(folder: Path) -> dict[str, str]:
    """Save one tiny checkpoint per family under `folder` (seed 0); name -> folder."""
    import torch

    from tests.conformance.families import FAMILIES

    specs = {spec.name: spec for spec in FAMILIES}
    saved = {}
    for name in CHECKPOINT_SPECS:
        spec = specs[name]
        torch.manual_seed(0)
        model = spec.model_class()(spec.make_config()).eval()
        model.generation_config.pad_token_id = 0
        model.save_pretrained(folder / name)
        saved[name] = str(folder / name)
    return saved


def fresh_greedy(
    folders: dict[str, str], workdir: Path, python: str = sys.executable
) -> subprocess.CompletedProcess:
    """Run `GREEDY_SCRIPT` over `folders` with `python` in an isolated process (own modules cache)."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "greedy.py").write_text(GREEDY_SCRIPT)
    environment = {**os.environ, "HF_MODULES_CACHE": str(workdir / "modules"), "HF_HUB_OFFLINE": "1"}
    environment.pop("HF_CONCEPT_IGNORE_TRANSFORMERS_RANGE", None)
    arguments = [json.dumps(folders), json.dumps(PROMPT), str(NEW_TOKENS)]
    return subprocess.run(
        [python, "-I", "greedy.py", *arguments],
        cwd=workdir,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )


def greedy_tokens(folders: dict[str, str], workdir: Path, python: str = sys.executable) -> dict:
    """name -> prompt and greedy tokens of each folder, loaded in an isolated process."""
    result = fresh_greedy(folders, workdir, python)
    if result.returncode != 0:
        raise AssertionError(f"isolated generation failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def legacy_code_available(commit: str = LEGACY_CODE_COMMIT) -> bool:
    """Whether the repository's history holds `commit` (a shallow clone does not)."""
    result = subprocess.run(
        ["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}^{{commit}}"],
        capture_output=True,
    )
    return result.returncode == 0


def put_legacy_code(folder: Path, commit: str = LEGACY_CODE_COMMIT) -> list[str]:
    """Replace the remote code of a saved `folder` with the code of `commit`: the files that version's
    `save_pretrained` copies (the auto_map modules and their relative imports). Returns them."""
    from hf_concept.hub import code_closure
    from hf_concept.upgrade import checkpoint_modules

    legacy = folder.parent / f".legacy-code-{folder.name}"
    legacy.mkdir(exist_ok=True)
    listing = subprocess.run(
        ["git", "-C", str(ROOT), "ls-tree", "--name-only", commit, f"{LEGACY_CODE_DIR}/"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for path in listing:
        if path.endswith(".py"):
            text = subprocess.run(
                ["git", "-C", str(ROOT), "show", f"{commit}:{path}"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            (legacy / Path(path).name).write_text(text)
    names = code_closure(legacy, checkpoint_modules(folder))
    for old in folder.glob("*.py"):
        old.unlink()
    for name in names:
        (folder / name).write_text((legacy / name).read_text())
    return names


def legacy_copies(saved: dict[str, str], folder: Path, commit: str = LEGACY_CODE_COMMIT) -> dict[str, str]:
    """Copies of the `saved` folders under `folder`, each with the code of `commit`."""
    legacy = {}
    for name, path in saved.items():
        legacy[name] = str(folder / name)
        shutil.copytree(path, legacy[name])
        write_older_config_values(Path(legacy[name]) / "config.json")
        put_legacy_code(Path(legacy[name]), commit)
    return legacy


def write_older_config_values(path: Path) -> None:
    """Rewrite the fields of OLDER_CONFIG_VALUES in the config file `path` as the older code saved them."""
    config = json.loads(path.read_text())
    for name, (newer, older) in OLDER_CONFIG_VALUES.items():
        if config.get(name, older) == newer:
            config[name] = older
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
