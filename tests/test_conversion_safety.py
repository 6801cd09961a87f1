"""Conversion never harms its source and leaves nothing behind that it does not clean up.

Source protection: `convert` (both targets) and `expand` refuse, with one stderr line naming both
paths and exit status 2, a destination that is the source (also through a symlink or as `./SRC`),
contains it, or lies inside it, even with `--overwrite`; every file of the source keeps its sha256.
Finite values: a NaN or inf in a source tensor is refused with an error naming the tensor and its
shard file, and no destination or staging folder is left. Leftovers of a killed conversion: the
hidden staging (`.NAME.tmp-*`) and retired (`.NAME.old-*`) folders carry a marker with their
process id; the next conversion into the same parent removes those whose process is dead, and keeps
live ones, unmarked look-alikes, other hosts' folders and a retired folder that still holds the only
copy of its destination.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_concept.cli import main
from hf_concept.conversion import convert_to_hidden_decoding, iter_source_tensors
from hf_concept.conversion.conceptmoe import convert_to_conceptmoe
from hf_concept.conversion.writer import MARKER
from tests.test_convert_conceptmoe import CONVERT_EXACT, entries, tiny_llama_folder

# The writer's module name: the marker's "writer" field and the logger's name.
WRITER = "hf_concept.conversion.writer"


def digests(folder) -> dict[str, str]:
    """Relative path -> sha256 of every file under `folder` (a new file shows up as a new key)."""
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


def run_cli(capsys, *argv) -> tuple[int, list[str]]:
    """Exit status and the non-empty stderr lines of `hf-concept argv...`, run in this process."""
    status = main([str(arg) for arg in argv])
    return status, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def hidden_decoding_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hd") / "two"
    source = tiny_llama_folder(folder.parent / "src")
    return convert_to_hidden_decoding(source, folder, num_streams=2)


VARIANTS = ["same", "dot", "symlinked source", "symlinked destination", "parent", "inside"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_convert_refuses_to_write_over_or_into_its_source(tmp_path, capsys, monkeypatch, variant):
    models = tmp_path / "models"
    source = tiny_llama_folder(models / "src")
    (models / "link").symlink_to(source, target_is_directory=True)
    monkeypatch.chdir(models)
    src, dst = {
        "same": (source, source),
        "dot": ("src", "./src"),
        "symlinked source": (models / "link", source),
        "symlinked destination": (source, models / "link"),
        "parent": (source, models),
        "inside": (source, source / "converted"),
    }[variant]
    before = digests(source)
    capsys.readouterr()
    flags = "--overwrite --encoder-layers 1 --decoder-layers 1 --chunking fixed --ratio 1"
    status, lines = run_cli(capsys, "convert", "conceptmoe", src, dst, *flags.split())
    assert digests(source) == before
    assert sorted(entries(models)) == ["link", "src"]
    assert status == 2
    assert len(lines) == 1 and "source" in lines[0] and "Traceback" not in lines[0], lines
    assert str(Path(src)) in lines[0] and str(Path(dst)) in lines[0], lines


def test_hidden_decoding_and_expand_refuse_their_source(tmp_path, capsys, hidden_decoding_checkpoint):
    source = tiny_llama_folder(tmp_path / "src")
    before = digests(source)
    capsys.readouterr()
    status, lines = run_cli(
        capsys, "convert", "hidden-decoding", source, source, "--streams", "2", "--overwrite"
    )
    assert digests(source) == before
    assert status == 2 and len(lines) == 1 and "source" in lines[0], lines
    checkpoint = hidden_decoding_checkpoint
    before = digests(checkpoint)
    status, lines = run_cli(capsys, "expand", checkpoint, checkpoint, "--streams", "4", "--overwrite")
    assert digests(checkpoint) == before
    assert status == 2 and len(lines) == 1 and "source" in lines[0], lines
    before = digests(source)
    with pytest.raises(ValueError, match="source"):
        convert_to_conceptmoe(source, tmp_path, overwrite=True, **CONVERT_EXACT)
    assert digests(source) == before


def poison(shard, value: float) -> str:
    """Write `value` into the first element of the first floating tensor of `shard`; returns its name."""
    tensors = load_file(shard)
    name = next(name for name, tensor in tensors.items() if tensor.is_floating_point())
    tensors[name].view(-1)[0] = value
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return name


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_source_values_are_named_and_nothing_is_written(tmp_path, value):
    source = tiny_llama_folder(tmp_path / "src")
    shard = sorted(source.glob("model-*.safetensors"))[1]
    name = poison(shard, value)
    with pytest.raises(ValueError, match=rf"{name}.*{shard.name}|{shard.name}.*{name}"):
        convert_to_conceptmoe(source, tmp_path / "dst", **CONVERT_EXACT)
    assert entries(tmp_path) == ["src"]
    with pytest.raises(ValueError, match=rf"{name}.*{shard.name}|{shard.name}.*{name}"):
        convert_to_hidden_decoding(source, tmp_path / "dst", num_streams=2)
    assert entries(tmp_path) == ["src"]


def test_non_finite_values_in_pickled_weights_are_named(tmp_path):
    torch.save({"weight": torch.tensor([1.0, float("-inf")])}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"'weight'.*pytorch_model\.bin"):
        list(iter_source_tensors(tmp_path, allow_pickle=True))


def dead_pid() -> int:
    process = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    return int(process.stdout)


def leftover(parent, folder_name: str, pid: int, destination: str, host: str | None = None):
    """A fake staging or retired folder as the writer makes it: a marker beside the checkpoint folder."""
    folder = parent / folder_name
    (folder / destination).mkdir(parents=True)
    (folder / destination / "model.safetensors").write_bytes(b"partial")
    owner = {"writer": WRITER, "pid": pid, "host": host or socket.gethostname(), "destination": destination}
    (folder / MARKER).write_text(json.dumps(owner))
    return folder


def test_stale_staging_folders_of_dead_processes_are_removed(tmp_path, caplog):
    source = tiny_llama_folder(tmp_path / "src")
    parent = tmp_path / "out"
    parent.mkdir()
    dead = dead_pid()
    stale = leftover(parent, ".a.tmp-dead", dead, "a")
    stale_retired = leftover(parent, ".c.old-dead", dead, "c")
    (parent / "c").mkdir()
    kept = [
        leftover(parent, ".a.tmp-live", os.getpid(), "a"),
        # Its destination is missing: the retired folder holds the only copy of the old checkpoint.
        leftover(parent, ".d.old-dead", dead, "d"),
        leftover(parent, ".e.tmp-remote", dead, "e", host="another-host.invalid"),
    ]
    unmarked = parent / ".b.tmp-unmarked"
    (unmarked / "b").mkdir(parents=True)
    elsewhere = leftover(tmp_path, "elsewhere", dead, "f")
    (parent / ".f.tmp-link").symlink_to(elsewhere, target_is_directory=True)
    (parent / ".g.tmp-file").write_text("a user's file")
    with caplog.at_level(logging.INFO, logger=WRITER):
        convert_to_conceptmoe(source, parent / "new", **CONVERT_EXACT)
    assert not stale.exists() and not stale_retired.exists()
    assert all(folder.is_dir() for folder in kept)
    assert (unmarked / "b").is_dir() and (elsewhere / MARKER).is_file()
    assert (parent / ".f.tmp-link").is_symlink() and (parent / ".g.tmp-file").is_file()
    assert (parent / "new" / "config.json").is_file() and (parent / "c").is_dir()
    messages = "\n".join(record.getMessage() for record in caplog.records)
    assert f"removed {stale}," in messages and f"removed {stale_retired}," in messages
    assert str(dead) in messages and f"kept {kept[1]}:" in messages
    assert str(kept[0]) not in messages and str(kept[2]) not in messages


@pytest.mark.slow
def test_a_killed_conversion_is_cleaned_up_by_the_next_one(tmp_path):
    script = textwrap.dedent(
        f"""
        import sys, time
        from hf_concept.conversion.writer import atomic_folder
        with atomic_folder({str(tmp_path / "out" / "killed")!r}) as folder:
            (folder / "model.safetensors").write_bytes(b"partial")
            print("writing", flush=True)
            time.sleep(600)
        """
    )
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "writing"
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        process.stdout.close()
    parent = tmp_path / "out"
    staging = [path for path in parent.iterdir() if path.name.startswith(".killed.tmp-")]
    assert len(staging) == 1 and not (parent / "killed").exists()
    convert_to_conceptmoe(tiny_llama_folder(tmp_path / "src"), parent / "new", **CONVERT_EXACT)
    assert entries(parent) == ["new"]
