"""`hf-concept train` reading through `datasets` (`hf_concept.training.datasets_io`): a chosen split of a
saved DatasetDict with a column filter, a jsonl file whose tokenized cache the next run (a new process)
loads instead of tokenizing again, `--streaming`, and one-line errors naming what exists."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
from transformers import PreTrainedTokenizerFast

import hf_concept.training.datasets_io as datasets_io
from hf_concept import cli
from hf_concept.training.data import read_documents, tokenize_documents
from hf_concept.training.datasets_io import CACHE_FOLDER, prepare_datasets, tokenizer_fingerprint
from tests.conformance.families import _plain_config
from tests.test_train_command import _paragraphs, make_workspace

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """The word-level tokenizer and data of test_train_command, a saved DatasetDict (train: 12 en + 8 ja
    rows; validation: 5 en + 3 ja), a tiny plain-decoder config, and a datasets cache of its own."""
    root = make_workspace(tmp_path_factory.mktemp("datasets"))
    texts = _paragraphs(2, 28)
    languages = ["en"] * 12 + ["ja"] * 8 + ["en"] * 5 + ["ja"] * 3
    rows = [{"text": text, "language": language} for text, language in zip(texts, languages, strict=True)]
    corpus = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows[:20]), "validation": datasets.Dataset.from_list(rows[20:])}
    )
    corpus.save_to_disk(str(root / "corpus"))
    (root / "config.json").write_text(_plain_config().to_json_string())
    return root


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "datasets-cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    return cache


def _train(capsys, workspace: Path, out: Path, *argv: str) -> tuple[int, str]:
    """Run `hf-concept train` in this process: (exit status, stderr)."""
    common = [workspace / "config.json", "--tokenizer", workspace / "tokenizer", "--output-dir", out]
    status = cli.main(["train", *map(str, [*common, *argv]), "--save-steps", "0", "--block-size", "16"])
    return status, capsys.readouterr().err


def _error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("hf-concept train: error:")]
    assert len(lines) == 1, stderr
    return lines[0]


def test_a_chosen_split_of_a_saved_datasetdict_filtered_by_language_trains(workspace, tmp_path, capsys):
    out = tmp_path / "out"
    status, stderr = _train(
        capsys, workspace, out, "--data", workspace / "corpus", "--data-split", "validation",
        "--data-filter", "language=en", "--max-steps", "2", "--eval-data", workspace / "corpus",
        "--eval-data-split", "validation",
    )  # fmt: skip
    assert status == 0, stderr
    # The validation split holds 5 English rows (train has 12): the split and the filter were both used.
    assert "hf-concept train: 5 documents -> " in stderr
    assert (out / "model.safetensors").is_file()
    state = json.loads((out / "checkpoints" / "trainer_state.json").read_text())
    assert state["global_step"] == 2


def test_jsonl_data_is_tokenized_once_and_the_next_run_loads_the_cache(
    workspace, tmp_path, capsys, monkeypatch, datasets_cache
):
    calls = []
    pieces = datasets_io.document_pieces
    monkeypatch.setattr(datasets_io, "document_pieces", lambda *args: calls.append(1) or pieces(*args))
    arguments = ["--data", workspace / "records.jsonl", "--max-steps", "1"]
    status, stderr = _train(capsys, workspace, tmp_path / "first", *arguments)
    assert status == 0, stderr
    assert "24 documents -> " in stderr and calls, "the first run did not tokenize"
    cached = sorted((datasets_cache / CACHE_FOLDER).glob("*.arrow"))
    assert cached
    # The next run is a new process: the cache key must not depend on anything but the data and settings.
    command = [sys.executable, "-m", "hf_concept.cli", "train", str(workspace / "config.json")]
    command += ["--tokenizer", str(workspace / "tokenizer"), "--output-dir", str(tmp_path / "second")]
    command += [*map(str, arguments), "--save-steps", "0", "--block-size", "16"]
    environment = {**os.environ, "DATASETS_VERBOSITY": "info", "PYTHONPATH": str(REPO)}
    second = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=120)
    assert second.returncode == 0, second.stderr
    assert f"Loading cached processed dataset at {datasets_cache / CACHE_FOLDER}" in second.stderr
    assert "Tokenizing" not in second.stderr, "the second run tokenized again"
    assert sorted((datasets_cache / CACHE_FOLDER).glob("*.arrow")) == cached


def test_another_block_size_or_tokenizer_is_a_new_cache_entry(workspace):
    tokenizer = PreTrainedTokenizerFast.from_pretrained(workspace / "tokenizer")
    data = workspace / "records.jsonl"
    first, _ = prepare_datasets(data, tokenizer, block_size=16)
    again, _ = prepare_datasets(data, tokenizer, block_size=16)
    longer, _ = prepare_datasets(data, tokenizer, block_size=32)
    assert first.cache_files == again.cache_files != longer.cache_files
    # The same pieces as the in-memory reader and tokenizer give.
    expected = tokenize_documents(read_documents(data), tokenizer, 16)
    assert first["input_ids"] == [sequence["input_ids"] for sequence in expected]
    changed = PreTrainedTokenizerFast.from_pretrained(workspace / "tokenizer", eos_token="<pad>")
    assert tokenizer_fingerprint(changed) != tokenizer_fingerprint(tokenizer)
    assert tokenizer_fingerprint(tokenizer) == tokenizer_fingerprint(
        PreTrainedTokenizerFast.from_pretrained(workspace / "tokenizer")
    )


def test_text_and_parquet_files_read_as_before(workspace, tmp_path):
    tokenizer = PreTrainedTokenizerFast.from_pretrained(workspace / "tokenizer")
    text = tmp_path / "spaced.txt"
    # A line of spaces ends a paragraph too, as `read_documents` has it.
    text.write_text("the cat sat .\n   \nthe dog ran .\n\n\n\na red bird\nsang .\n")
    parquet = tmp_path / "records.parquet"
    datasets.Dataset.from_list([{"text": "the big tree ."}, {"text": "a small river ."}]).to_parquet(parquet)
    train, _ = prepare_datasets([text, parquet], tokenizer, block_size=16, text_field="text")
    documents = [*read_documents(text), "the big tree .", "a small river ."]
    expected = tokenize_documents(documents, tokenizer, 16)
    assert len(train) == 5 and train["input_ids"] == [sequence["input_ids"] for sequence in expected]


def test_streaming_trains_and_needs_max_steps(workspace, tmp_path, capsys):
    out = tmp_path / "out"
    status, stderr = _train(
        capsys, workspace, out, "--data", workspace / "corpus", "--streaming", "--max-steps", "3"
    )
    assert status == 0, stderr
    assert "streaming" in stderr and (out / "model.safetensors").is_file()
    assert json.loads((out / "checkpoints" / "trainer_state.json").read_text())["global_step"] == 3
    status, stderr = _train(
        capsys, workspace, tmp_path / "no-steps", "--data", workspace / "corpus", "--streaming"
    )
    assert status == 2 and "--streaming needs --max-steps N" in _error_line(stderr)


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (
            ["--data-split", "test"],
            "--data-split 'test' is not a split of {corpus} (splits: train, validation)",
        ),
        (
            ["--text-field", "story"],
            "text field 'story' is not a column of {corpus} (columns: text, language)",
        ),
        (["--data-filter", "kind=prose"], "--data-filter column 'kind' is not a column of {corpus}"),
        (["--data-filter", "language=fr"], "with --data-filter language=fr holds no documents"),
    ],
)
def test_a_missing_split_column_or_row_is_one_line_naming_what_exists(
    workspace, tmp_path, capsys, flags, named
):
    status, stderr = _train(capsys, workspace, tmp_path / "out", "--data", workspace / "corpus", *flags)
    assert status == 2
    assert named.format(corpus=workspace / "corpus") in _error_line(stderr)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("content", ["", "\n\n"])
def test_an_empty_jsonl_file_is_one_line_naming_it(workspace, tmp_path, capsys, content):
    empty = tmp_path / "empty.jsonl"
    empty.write_text(content)
    status, stderr = _train(capsys, workspace, tmp_path / "out", "--data", empty, "--max-steps", "1")
    assert status == 2, stderr[-2000:]
    assert str(empty) in _error_line(stderr) and "Traceback" not in stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("line", "named"),
    [
        ('{"text": 42}', "line 3: 'text' is a int, not a string"),
        ('{"body": "no text here"}', "line 3 has no 'text' field"),
        ('["a list"]', "line 3 is a JSON list, not an object"),
        ('{"text": "cut', "line 3 is not JSON"),
    ],
)
def test_a_jsonl_record_without_a_string_text_is_refused_naming_its_line(
    workspace, tmp_path, capsys, line, named
):
    data = tmp_path / "data.jsonl"
    good = json.dumps({"text": "the first document has words"})
    data.write_text(f"{good}\n\n{line}\n{good}\n")
    status, stderr = _train(capsys, workspace, tmp_path / "out", "--data", data, "--max-steps", "1")
    assert status == 2, stderr[-2000:]
    assert named in _error_line(stderr) and str(data) in _error_line(stderr)
    assert not (tmp_path / "out").exists()


def test_a_jsonl_file_that_is_not_utf8_names_the_byte_before_its_records_are_read(
    workspace, tmp_path, capsys
):
    data = tmp_path / "latin1.jsonl"
    data.write_bytes('{"text": "un caf\u00e9 noir"}\n'.encode("latin-1"))
    status, stderr = _train(capsys, workspace, tmp_path / "out", "--data", data, "--max-steps", "1")
    assert status == 2, stderr[-2000:]
    assert "is not valid UTF-8 at byte offset 16" in _error_line(stderr)
    assert not (tmp_path / "out").exists()
