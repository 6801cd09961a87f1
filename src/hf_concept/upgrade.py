"""Rewrite a saved checkpoint's remote code to this version of the package (`hf-concept upgrade`).

A folder saved by `save_pretrained` (or a conversion) carries a copy of the modeling code from the day it
was written; transformers runs that copy, so a folder saved before a transformers release that renamed
something keeps the old names. Upgrading replaces the copy with the package's current code:

- A folder is recognised by its `config.json`: a `model_type` of one of the package's families and an
  `auto_map` whose modules are present in the folder. Anything else is refused (`UpgradeError`, naming
  the file and what is wrong) before anything is written.
- The new code is every module the `auto_map` entries (of `config.json` and `tokenizer_config.json`)
  name, with the siblings they import, taken from `hf_concept.modeling` (`hub.code_closure`, the walk
  `push` checks a folder with). Code files the old modules imported and the new ones do not are
  removed; every other file (weights, config, tokenizer, a user's own files) is kept byte for byte.
- The rewrite is atomic (`conversion.writer.atomic_folder`): the new folder is built beside the old one,
  weights hard-linked where the file system allows, and swapped in only once complete.
"""

from __future__ import annotations

import filecmp
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import hf_concept.modeling as modeling_package
from hf_concept.conversion.writer import atomic_folder
from hf_concept.hub import auto_map_modules, code_closure

MODELING_DIR = Path(modeling_package.__file__).parent
FAMILY_MODEL_TYPES = ("conceptmoe", "dlcm", "hidden_decoding", "lslm", "hf_concept_plain")


class UpgradeError(ValueError):
    """A folder `upgrade` does not recognise or cannot rewrite; nothing was changed."""


@dataclass
class UpgradePlan:
    """What `upgrade` writes: code files replaced (differing), added, removed; those already current."""

    replaced: list[str] = field(default_factory=list)
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)

    @property
    def changes(self) -> bool:
        return bool(self.replaced or self.added or self.removed)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UpgradeError(f"{path} is missing: not a saved checkpoint folder") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UpgradeError(f"{path} is not readable JSON ({error})") from None
    if not isinstance(data, dict):
        raise UpgradeError(f"{path} is not a JSON object")
    return data


def checkpoint_modules(folder: Path) -> list[tuple[str, str]]:
    """(module, where it is named) for the modules the folder's auto_maps name (`hub.auto_map_modules`),
    after checking that the folder is one of the package's checkpoints and holds them."""
    config_path = folder / "config.json"
    config = _read_json(config_path)
    model_type = config.get("model_type")
    if model_type not in FAMILY_MODEL_TYPES:
        raise UpgradeError(
            f"{config_path}: model_type {model_type!r} is not one of hf_concept's families "
            f"({', '.join(FAMILY_MODEL_TYPES)}); nothing changed"
        )
    try:
        named = auto_map_modules(folder, config)
    except ValueError as error:  # an unreadable tokenizer_config.json
        raise UpgradeError(str(error)) from None
    if not named:
        raise UpgradeError(f"{config_path} has no auto_map: the folder carries no remote code to upgrade")
    missing = sorted(module for module, _ in named if not (folder / f"{module}.py").is_file())
    if missing:
        raise UpgradeError(f"{config_path}: auto_map names {missing}, which the folder does not hold")
    return named


def plan_upgrade(folder: str | Path) -> UpgradePlan:
    """What upgrading `folder` would change (UpgradeError for a folder it does not recognise)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UpgradeError(f"{folder} is not a folder")
    named = checkpoint_modules(folder)
    try:
        new_files = code_closure(MODELING_DIR, named)
    except ValueError as error:
        raise UpgradeError(f"this version of hf_concept cannot provide the folder's code: {error}") from None
    # A folder's old copy may be incomplete: what is missing is simply added by the upgrade.
    old_files = code_closure(folder, named, skip_missing=True)
    plan = UpgradePlan(removed=[name for name in old_files if name not in new_files])
    for name in new_files:
        target = folder / name
        if not target.is_file():
            plan.added.append(name)
        elif filecmp.cmp(target, MODELING_DIR / name, shallow=False):
            plan.unchanged.append(name)
        else:
            plan.replaced.append(name)
    return plan


def _link_or_copy(source: str, destination: str) -> None:
    """Hard-link a kept file into the new folder (no second copy of the weights), else copy it."""
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)


def upgrade_folder(folder: str | Path) -> UpgradePlan:
    """Rewrite `folder`'s remote code to this version's; weights, config and other files are kept."""
    folder = Path(folder)
    plan = plan_upgrade(folder)
    if not plan.changes:
        return plan
    dropped = set(plan.removed) | set(plan.replaced)
    with atomic_folder(folder, overwrite=True) as staging:
        for entry in folder.iterdir():
            if entry.name in dropped:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.copytree(entry, staging / entry.name, symlinks=True, copy_function=_link_or_copy)
            elif entry.is_symlink():
                os.symlink(os.readlink(entry), staging / entry.name)
            else:
                _link_or_copy(str(entry), str(staging / entry.name))
        for name in plan.replaced + plan.added:
            shutil.copyfile(MODELING_DIR / name, staging / name)
    return plan
