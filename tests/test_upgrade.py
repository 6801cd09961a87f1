"""`hf-concept upgrade FOLDER`: a folder saved with an earlier version's remote code loads and generates
the same tokens after the upgrade, and carries exactly the current code (files the current code no longer
imports are removed); anything it does not recognise is refused and left as it was."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from hf_concept.cli import main
from hf_concept.modeling.transformers_compat import CACHE_NAME
from tests.conformance.families import FAMILIES
from tests.saved_checkpoints import (
    fresh_greedy,
    greedy_tokens,
    legacy_code_available,
    legacy_copies,
    save_checkpoints,
)

SPECS = {spec.name: spec for spec in FAMILIES}
# A version whose LSLM code imports the concept families' modules (concept_stack, chunking, concept_cache)
# and whose LSLM and Hidden Decoding code import the plain decoder's model (modeling_plain): folders it
# saved carry files the current code of those families does not use.
WIDER_CLOSURE_COMMIT = "29a62fb"


def digest(folder: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under `folder`."""
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, str]:
    return save_checkpoints(tmp_path_factory.mktemp("saved"))


@pytest.mark.skipif(not legacy_code_available(), reason="needs the repository history (not a shallow clone)")
def test_a_legacy_folder_generates_the_same_tokens_after_upgrade(saved, tmp_path, capsys):
    reference = greedy_tokens(saved, tmp_path / "reference")
    legacy = legacy_copies(saved, tmp_path / "legacy")
    kept = {
        name: {k: v for k, v in digest(Path(f)).items() if not k.endswith(".py")}
        for name, f in legacy.items()
    }
    before = fresh_greedy(legacy, tmp_path / "before")
    if CACHE_NAME == "cache":
        # The legacy code passes past_key_values, which this release's generate no longer does.
        assert before.returncode != 0 and "cache" in before.stderr, before.stderr[-2000:]
    else:
        assert json.loads(before.stdout.splitlines()[-1]) == reference
    for name, folder in legacy.items():
        assert main(["upgrade", folder]) == 0
        report = capsys.readouterr().out
        assert "transformers_compat.py" in report and "weights and config untouched" in report, report
        assert {k: v for k, v in digest(Path(folder)).items() if not k.endswith(".py")} == kept[name]
        assert main(["upgrade", folder]) == 0
        assert "already this version's" in capsys.readouterr().out
    assert greedy_tokens(legacy, tmp_path / "after") == reference


def test_upgrade_refuses_what_it_does_not_recognise_and_changes_nothing(saved, tmp_path, capsys):
    cases = {}
    cases["config.json is missing"] = tmp_path / "empty"
    cases["config.json is missing"].mkdir()
    foreign = tmp_path / "llama"
    shutil.copytree(saved["plain"], foreign)
    config = json.loads((foreign / "config.json").read_text())
    (foreign / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    cases["model_type 'llama'"] = foreign
    no_map = tmp_path / "no-map"
    shutil.copytree(saved["dlcm"], no_map)
    config = json.loads((no_map / "config.json").read_text())
    config.pop("auto_map")
    (no_map / "config.json").write_text(json.dumps(config))
    cases["has no auto_map"] = no_map
    no_code = tmp_path / "no-code"
    shutil.copytree(saved["lslm"], no_code)
    (no_code / "modeling_lslm.py").unlink()
    cases["does not hold"] = no_code
    broken = tmp_path / "broken"
    shutil.copytree(saved["conceptmoe-first"], broken)
    (broken / "config.json").write_text("{not json")
    cases["not readable JSON"] = broken
    for expected, folder in cases.items():
        before = digest(folder)
        assert main(["upgrade", str(folder)]) == 2, expected
        error = capsys.readouterr().err
        assert expected in error and len(error.strip().splitlines()) == 1, error
        assert digest(folder) == before
        assert sorted(path.name for path in folder.parent.iterdir() if path.name.startswith(".")) == []


def test_an_interrupted_upgrade_leaves_the_folder_as_it_was(saved, tmp_path, monkeypatch):
    folder = tmp_path / "hd"
    shutil.copytree(saved["hidden-decoding"], folder)
    (folder / "modeling_hidden_decoding.py").write_text("# an older copy\n")
    before = digest(folder)
    calls = []

    def failing_copy(source, destination, **kwargs):
        calls.append(destination)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("hf_concept.upgrade.shutil.copyfile", failing_copy)
    assert main(["upgrade", str(folder)]) == 2
    assert calls and digest(folder) == before
    assert [path.name for path in tmp_path.iterdir() if path.name.startswith(".")] == []


def test_dry_run_names_the_changes_and_writes_nothing(saved, tmp_path, capsys):
    folder = tmp_path / "dlcm"
    shutil.copytree(saved["dlcm"], folder)
    (folder / "transformers_compat.py").unlink()
    (folder / "routing.py").write_text("# an older copy\n")
    before = digest(folder)
    assert main(["upgrade", "--dry-run", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "would change" in out and "replaced: routing.py" in out and "added: transformers_compat.py" in out
    assert digest(folder) == before


@pytest.mark.skipif(
    not legacy_code_available(WIDER_CLOSURE_COMMIT),
    reason="needs the repository history (not a shallow clone)",
)
def test_an_upgrade_removes_the_files_the_current_code_no_longer_imports(saved, tmp_path, capsys):
    reference = greedy_tokens(saved, tmp_path / "reference")
    older = legacy_copies(saved, tmp_path / "older", commit=WIDER_CLOSURE_COMMIT)
    # The older closures, and the modules renamed since to name the family that owns them.
    dropped = {
        "lslm": "boundary_rules.py, chunking.py, concept_cache.py, concept_stack.py, modeling_plain.py, "
        "segment_cache.py, segment_estimators.py",
        "hidden-decoding": "modeling_plain.py, stream_cache.py, stream_layers.py, streams.py",
        "conceptmoe-first": "chunking.py, scan.py, smoothing.py",
        "dlcm": "chunking.py, replication.py, scan.py, smoothing.py",
    }
    for name, files in dropped.items():
        assert set(files.split(", ")) <= {path.name for path in Path(older[name]).glob("*.py")}, name
    assert greedy_tokens(older, tmp_path / "before") == reference
    for name, folder in older.items():
        assert main(["upgrade", folder]) == 0
        report = capsys.readouterr().out
        if name in dropped:
            assert f"  removed: {dropped[name]}\n" in report, report
        else:
            assert "removed:" not in report, report
        assert {path.name for path in Path(folder).glob("*.py")} == set(SPECS[name].remote_code_files)
    assert greedy_tokens(older, tmp_path / "after") == reference
