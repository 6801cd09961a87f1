"""`hf-concept push` and `hf_concept.hub`, offline: a recording HfApi stands in for the Hub.

The recorder keeps the `CommitOperationAdd`s of the one `create_commit` push makes, so the tests see the
files (and the card text) the real call would send. Failures: tests/test_push_faults.py.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import pytest
from huggingface_hub import ModelCard

from hf_concept import hub
from hf_concept.cli import main
from tests.conformance.families import FAMILIES

SPECS = {spec.name: spec for spec in FAMILIES}
JUNK = (".git/HEAD", ".DS_Store", "__pycache__/modeling_conceptmoe.cpython-311.pyc", "layers.pyc")
TRAINER_CHECKPOINT = "checkpoint-5/model.safetensors"
# Where `hf-concept train` keeps Trainer checkpoints inside its output folder.
TRAIN_COMMAND_CHECKPOINT = "checkpoints/checkpoint-10/model.safetensors"


class RecordingHfApi:
    """Records create_repo / create_branch / create_commit; a bare repo name gets the namespace "me"."""

    instances: ClassVar[list[RecordingHfApi]] = []

    def __init__(self, token: str | None = None) -> None:
        self.token = token
        self.calls: list[tuple[str, dict]] = []
        self.uploaded: list[str] = []
        RecordingHfApi.instances.append(self)

    def create_repo(self, **kwargs):
        self.calls.append(("create_repo", kwargs))
        repo_id = kwargs["repo_id"] if "/" in kwargs["repo_id"] else f"me/{kwargs['repo_id']}"
        return SimpleNamespace(repo_id=repo_id)

    def create_branch(self, **kwargs):
        self.calls.append(("create_branch", kwargs))

    def create_commit(self, **kwargs):
        self.calls.append(("create_commit", kwargs))
        self.uploaded = sorted(operation.path_in_repo for operation in kwargs["operations"])
        return SimpleNamespace(commit_url=f"https://huggingface.co/{kwargs['repo_id']}/commit/abc123")


@pytest.fixture
def recorder(monkeypatch):
    RecordingHfApi.instances = []
    monkeypatch.setattr(hub, "HfApi", RecordingHfApi)
    # push checks that a token is configured before it builds the HfApi.
    monkeypatch.setenv("HF_TOKEN", "hf_recorder")
    return RecordingHfApi


def save_tiny(spec_name: str, folder: Path) -> Path:
    """A tiny model of the family saved with save_pretrained (remote code copied by register_for_auto_class),
    a small tokenizer, and the junk a working folder collects."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    spec = SPECS[spec_name]
    spec.model_class()(spec.make_config()).save_pretrained(folder)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "hello": 4, "world": 5}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>")
    tokenizer.save_pretrained(folder)
    for name in (*JUNK, TRAINER_CHECKPOINT, TRAIN_COMMAND_CHECKPOINT):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(b"junk")
    return folder


def needed_code(folder: Path) -> set[str]:
    """The .py files transformers loads for the auto_map entries, computed with its own resolver."""
    from transformers.dynamic_module_utils import get_relative_import_files

    auto_map = json.loads((folder / "config.json").read_text())["auto_map"]
    files = set()
    for reference in auto_map.values():
        module_file = folder / f"{reference.split('.')[0]}.py"
        files |= {
            module_file.name,
            *(Path(path).name for path in get_relative_import_files(str(module_file))),
        }
    return files


def test_conceptmoe_push_creates_the_repo_and_uploads_every_needed_file(tmp_path, recorder):
    folder = save_tiny("conceptmoe-first", tmp_path / "ckpt")
    url = hub.push_checkpoint(folder, "org/tiny-cmoe", private=True, report=lambda message: None)
    assert url == "https://huggingface.co/org/tiny-cmoe/commit/abc123"
    (api,) = recorder.instances
    assert [name for name, _ in api.calls] == ["create_repo", "create_commit"]
    assert api.calls[0][1] == dict(
        repo_id="org/tiny-cmoe", private=True, exist_ok=True, repo_type="model", token=None
    )
    upload = api.calls[1][1]
    assert upload["repo_id"] == "org/tiny-cmoe" and upload["revision"] is None
    assert upload["repo_type"] == "model" and upload["commit_message"].startswith("Upload conceptmoe")
    code = needed_code(folder)
    # What save_pretrained copied for ConceptMoE: the auto_map modules and their sibling imports.
    assert code >= {"modeling_conceptmoe.py", "configuration_conceptmoe.py", "configuration_plain.py"}
    assert code >= {"layers.py", "concept_cache.py", "concept_chunking.py", "routing.py", "modeling_plain.py"}
    assert code == {path.name for path in folder.glob("*.py")}
    expected = {"config.json", "generation_config.json", "model.safetensors", "README.md"}
    expected |= {"tokenizer.json", "tokenizer_config.json"} | code
    assert set(api.uploaded) == expected
    assert sorted(hub.check_checkpoint(folder)) == sorted(code)
    data = ModelCard.load(folder / "README.md").data.to_dict()
    assert data["tags"] == ["custom_code", "conceptmoe", "hf_concept"]
    text = (folder / "README.md").read_text()
    assert 'AutoModelForCausalLM.from_pretrained("org/tiny-cmoe", trust_remote_code=True)' in text


def test_converted_hidden_decoding_push_to_a_new_branch_rewrites_the_card(tmp_path, recorder):
    from hf_concept.conversion.hidden_decoding import convert_to_hidden_decoding
    from hf_concept.model_card import write_model_card
    from tests.test_convert_conceptmoe import tiny_llama_folder

    source = tiny_llama_folder(tmp_path / "src")
    folder = convert_to_hidden_decoding(source, tmp_path / "hd", num_streams=2, base_model="org/tiny-llama")
    write_model_card(folder, evaluation={"eval_loss": 4.25})
    messages = []
    hub.push_checkpoint(folder, "tiny-hd", revision="v1", token="hf_test", report=messages.append)
    (api,) = recorder.instances
    assert api.calls[0] == (
        "create_repo",
        dict(repo_id="tiny-hd", private=False, exist_ok=True, repo_type="model", token="hf_test"),
    )
    branch = dict(repo_id="me/tiny-hd", branch="v1", exist_ok=True, repo_type="model", token="hf_test")
    assert api.calls[1] == ("create_branch", branch)
    upload = api.calls[2][1]
    assert (upload["repo_id"], upload["revision"], upload["token"]) == ("me/tiny-hd", "v1", "hf_test")
    assert set(api.uploaded) == {path.name for path in folder.iterdir()}
    assert needed_code(folder) <= set(api.uploaded) and "hidden_decoding_cache.py" in api.uploaded
    # The converter's card named the local folder; the pushed card names the repo and keeps the facts.
    card_path = folder / "README.md"
    assert messages == [f"rewrote the model card at {card_path} (its load snippet names 'me/tiny-hd')"]
    card = ModelCard.load(card_path)
    assert card.data.to_dict()["hf_concept"]["evaluation"] == {"eval_loss": 4.25}
    assert card.data.to_dict()["hidden_decoding"]["source_model_type"] == "llama"
    assert '.from_pretrained("me/tiny-hd", trust_remote_code=True)' in card.text


def test_an_edited_or_foreign_card_is_uploaded_unchanged(tmp_path, recorder):
    folder = save_tiny("hidden-decoding", tmp_path / "ckpt")
    from hf_concept.model_card import write_model_card

    write_model_card(folder)
    edited = (folder / "README.md").read_text() + "\nMy own notes.\n"
    (folder / "README.md").write_text(edited)
    plan = hub.plan_upload(folder, "org/hd")
    assert plan.card_action == "kept" and "edited after hf_concept wrote it" in plan.notes[0]
    hub.push_checkpoint(folder, "org/hd")
    assert (folder / "README.md").read_text() == edited
    (folder / "README.md").write_text("# my card\n")
    assert hub.plan_upload(folder, "org/hd").card_action == "kept"


def parse_listing(out: str) -> list[tuple[int, str]]:
    rows = []
    for line in out.splitlines()[1:]:
        size, _, rest = line.strip().partition("  ")
        if not size.isdigit() or rest.startswith("total"):
            continue
        rows.append((int(size), rest.split("  (")[0]))
    return rows


def test_dry_run_lists_exactly_what_the_push_uploads(tmp_path, recorder, capsys):
    folder = save_tiny("conceptmoe-first", tmp_path / "ckpt")
    before = sorted(path.relative_to(folder).as_posix() for path in folder.rglob("*"))
    assert main(["push", str(folder), "org/tiny-cmoe", "--private", "--revision", "dev", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert recorder.instances == [] and not (folder / "README.md").exists()
    assert sorted(path.relative_to(folder).as_posix() for path in folder.rglob("*")) == before
    assert out.startswith(
        "dry run: would upload to model repo org/tiny-cmoe (private if created), branch dev:"
    )
    listed = parse_listing(out)
    assert "README.md  (model card written by push: the folder has none)" in out
    on_disk = [(size, path) for size, path in listed if path != "README.md"]
    assert on_disk == [((folder / path).stat().st_size, path) for _, path in on_disk]
    total = sum(size for size, _ in listed)
    assert f"{total:>12}  total, {len(listed)} files" in out
    assert f"remote code: the {len(needed_code(folder))} .py files that auto_map needs are all present" in out
    for skipped in (".git/ (hidden)", ".DS_Store (hidden)", "__pycache__/ (Python cache)", "layers.pyc"):
        assert f"not uploaded: {skipped}" in out
    assert "not uploaded: checkpoint-5/ (Trainer checkpoint; pass --include-checkpoints" in out
    assert "not uploaded: checkpoints/ (Trainer checkpoint; pass --include-checkpoints" in out

    assert main(["push", str(folder), "org/tiny-cmoe", "--private", "--revision", "dev"]) == 0
    out = capsys.readouterr().out
    (api,) = recorder.instances
    assert api.uploaded == [path for _, path in listed]
    readme_size = next(size for size, path in listed if path == "README.md")
    assert (folder / "README.md").stat().st_size == readme_size
    assert "wrote a model card at" in out and "pushed" in out and "/org/tiny-cmoe/commit/" in out
    assert Path(TRAINER_CHECKPOINT) in hub.files_to_upload(folder, include_checkpoints=True)
    assert Path(TRAINER_CHECKPOINT) not in hub.files_to_upload(folder)


def run_push(capsys, *argv) -> tuple[int, list[str]]:
    status = main(["push", *map(str, argv)])
    return status, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def test_errors_are_one_line_and_nothing_is_sent(tmp_path, recorder, capsys):
    folder = save_tiny("conceptmoe-first", tmp_path / "ckpt")
    capsys.readouterr()
    broken = tmp_path / "broken"

    def fresh_copy():
        shutil.rmtree(broken, ignore_errors=True)
        return Path(shutil.copytree(folder, broken))

    cases = [
        (tmp_path / "nowhere", "org/x", r"checkpoint folder '.*nowhere' does not exist"),
        (folder / "config.json", "org/x", r"is not a folder"),
        (folder, "org/x/y", r"repo_id='org/x/y' is not a Hub repo id"),
        (folder, "bad name", r"repo_id='bad name' is not a Hub repo id"),
    ]
    for path, repo_id, pattern in cases:
        status, err = run_push(capsys, path, repo_id)
        assert status == 2 and len(err) == 1 and err[0].startswith("hf-concept push: error: "), err
        assert re.search(pattern, err[0]), err
    removals = {
        "config.json": r"no config\.json in '.*broken'",
        "model.safetensors": r"no weights in '.*broken': expected model\.safetensors",
        "modeling_conceptmoe.py": r"modeling_conceptmoe\.py is missing from '.*': config\.json auto_map\[",
        "concept_cache.py": r"concept_cache\.py is missing from '.*': \w+\.py imports it \(from \.concept",
    }
    for name, pattern in removals.items():
        (fresh_copy() / name).unlink()
        status, err = run_push(capsys, broken, "org/x")
        assert status == 2 and len(err) == 1 and re.search(pattern, err[0]), (name, err)
    assert recorder.instances == []


def test_a_missing_shard_and_a_peft_adapter_are_named(tmp_path):
    spec = SPECS["plain"]
    spec.model_class()(spec.make_config()).save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    shards = sorted((tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    with pytest.raises(ValueError, match=rf"index\.json names {shards[-1].name}, which is missing"):
        hub.check_checkpoint(tmp_path / "sharded")
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"no config\.json .*PEFT adapter: merge it"):
        hub.check_checkpoint(tmp_path / "adapter")


def test_a_failed_upload_exits_1_with_one_line(tmp_path, capsys, monkeypatch):
    import huggingface_hub.constants

    # The real HfApi, with offline mode on: it must fail fast and be reported, not raise.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    folder = save_tiny("plain", tmp_path / "ckpt")
    capsys.readouterr()
    status, err = run_push(capsys, folder, "org/tiny", "--token", "hf_unused")
    assert status == 1 and len(err) == 1
    assert err[0].startswith("hf-concept push: error: upload to 'org/tiny' failed:") and "offline" in err[0]


def test_help_says_what_is_left_out(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["push", "--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for text in (".git/", "__pycache__/", "*.pyc", "checkpoint-*/", "--include-checkpoints", "--dry-run"):
        assert text in out
    assert "HF_TOKEN" in out and "push writes one" in out


def test_lslm_push_needs_the_tokenizer_code_too(tmp_path):
    from hf_concept.modeling.tokenization_lslm import ByteTokenizer

    folder = tmp_path / "lslm"
    SPECS["lslm"].model_class()(SPECS["lslm"].make_config()).save_pretrained(folder)
    ByteTokenizer().save_pretrained(folder)
    plan = hub.plan_upload(folder, "org/tiny-lslm")
    assert "tokenization_lslm.py" in plan.code_files and "modeling_lslm.py" in plan.code_files
    assert 'AutoTokenizer.from_pretrained("org/tiny-lslm", trust_remote_code=True)' in plan.card_text
    (folder / "tokenization_lslm.py").unlink()
    pattern = r"tokenization_lslm\.py is missing .*: tokenizer_config\.json auto_map\['AutoTokenizer'\]"
    with pytest.raises(ValueError, match=pattern):
        hub.plan_upload(folder, "org/tiny-lslm")


TRAINING_STATE = (
    "optimizer.pt",
    "scheduler.pt",
    "rng_state.pth",
    "rng_state_1.pth",
    "scaler.pt",
    "training_args.bin",
    "trainer_state.json",
    "run_settings.json",
    "global_step10/mp_rank_00_model_states.pt",
)


def test_a_raw_trainer_checkpoint_is_pushed_without_its_training_state(tmp_path, recorder, capsys):
    """A `checkpoint-N` folder as Trainer writes it: the model and tokenizer go up, the optimizer, scheduler,
    RNG and trainer state stay home and are listed, unless --include-training-state."""
    folder = save_tiny("conceptmoe-first", tmp_path / "checkpoint-10")
    for name in TRAINING_STATE:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(b"state")
    before = {path: path.read_bytes() for path in folder.rglob("*") if path.is_file()}
    assert main(["push", str(folder), "org/tiny-cmoe"]) == 0
    out = capsys.readouterr().out
    uploaded = set(recorder.instances[-1].uploaded)
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= uploaded
    assert not uploaded & {name.split("/")[0] for name in TRAINING_STATE}
    assert not any(path.startswith("global_step10/") for path in uploaded)
    for name in (
        "optimizer.pt",
        "rng_state_1.pth",
        "training_args.bin",
        "trainer_state.json",
        "global_step10/",
    ):
        assert f"not uploaded: {name} (training state, not read by from_pretrained" in out, name
    # The folder keeps every file it had (the new card is added once the upload succeeded).
    assert all(path.read_bytes() == data for path, data in before.items())

    assert main(["push", str(folder), "org/tiny-cmoe", "--include-training-state"]) == 0
    uploaded = set(recorder.instances[-1].uploaded)
    assert {
        "optimizer.pt",
        "rng_state.pth",
        "trainer_state.json",
        "global_step10/mp_rank_00_model_states.pt",
    } <= uploaded


@pytest.mark.parametrize("include_checkpoints", [False, True])
@pytest.mark.parametrize("include_training_state", [False, True])
def test_the_selection_is_upload_folders_ignore_patterns(
    tmp_path, include_checkpoints, include_training_state
):
    """huggingface_hub's matcher, given `upload_ignore_patterns`, keeps exactly the files push uploads, as
    `HfApi.upload_folder(..., ignore_patterns=...)` would; the listing names each left-out entry once."""
    from huggingface_hub.utils import filter_repo_objects

    folder = save_tiny("plain-moe", tmp_path / "ckpt")
    nested = ("sub/.hidden", "sub/__pycache__/x.pyc", "sub/optimizer.pt", "sub/checkpoint-1/a.bin", "x.pyo")
    for name in (*TRAINING_STATE, *nested):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(b"state")
    flags = dict(include_checkpoints=include_checkpoints, include_training_state=include_training_state)
    every_file = sorted(path.relative_to(folder).as_posix() for path in folder.rglob("*") if path.is_file())
    patterns = hub.upload_ignore_patterns(**flags)
    kept = list(filter_repo_objects(every_file, ignore_patterns=patterns))
    files, skipped = hub.scan_folder(folder, **flags)
    assert [path.as_posix() for path in files] == kept
    # Top-level rules stay top-level: the nested look-alikes are uploaded.
    assert {"sub/optimizer.pt", "sub/checkpoint-1/a.bin"} <= set(kept)
    assert (TRAINER_CHECKPOINT in kept) == include_checkpoints
    assert ("optimizer.pt" in kept) == include_training_state
    entries = [entry.split(" (")[0] for entry in skipped]
    assert len(entries) == len(set(entries))
    assert {".git/", "sub/.hidden", "sub/__pycache__/", "x.pyo"} <= set(entries)
    assert ("checkpoint-5/" in entries) != include_checkpoints
    assert ("global_step10/" in entries) != include_training_state
