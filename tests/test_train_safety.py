"""`hf-concept train` (and `convert` / `expand`) never lose a model and say what is wrong in one line.

- `--resume` into a folder that holds a saved model but no complete checkpoint is refused, not trained
  from step 0 over that model.
- `--resume-from` a checkpoint of another config (ratio), family or size is refused naming the fields;
  a full checkpoint under `--lora` is refused; a step target below the checkpoint's step is refused, and
  one at it trains nothing and says so.
- A checkpoint with NaN weights is named with its tensors (no blame on the learning rate); a garbage
  safetensors header and a truncated `optimizer.pt` are named by the completeness check.
- A full disk while a checkpoint or the final model is written: one line, nothing half-written.
- A read-only output folder: one line from `train`, `convert` and `expand`, nothing written. Under root,
  where chmod does not stop writes, the writes into that folder are refused by patching the os calls.
"""

from __future__ import annotations

import builtins
import errno
import hashlib
import io
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_concept import cli
from hf_concept.training.checkpoints import checkpoint_problems, safetensors_problem
from tests.conformance.families import _conceptmoe_config, _dlcm_config
from tests.test_convert_conceptmoe import tiny_llama_folder
from tests.test_train_command import make_workspace

CONFIGS = {
    "conceptmoe": _conceptmoe_config,
    "ratio 4": lambda: _conceptmoe_config(compression_ratio=4.0),
    "dlcm": _dlcm_config,
    "wider": lambda: _conceptmoe_config(hidden_size=48, head_dim=12),
}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root = make_workspace(tmp_path_factory.mktemp("safety"))
    for name, make in CONFIGS.items():
        (root / f"{name}.json").write_text(make().to_json_string())
    return root


def _run(workspace: Path, out: Path, *extra: str, config: str = "conceptmoe") -> int:
    argv = [
        "train", str(workspace / f"{config}.json"), "--data", str(workspace / "corpus.txt"),
        "--tokenizer", str(workspace / "tokenizer"), "--output-dir", str(out), "--block-size", "32",
        "--per-device-train-batch-size", "4", "--logging-steps", "1", "--learning-rate", "3e-3", *extra,
    ]  # fmt: skip
    return cli.main(argv)


def _error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if ": error:" in line]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _global_step(out: Path) -> int:
    return json.loads((out / "checkpoints" / "trainer_state.json").read_text())["global_step"]


@pytest.fixture(scope="module")
def finished(workspace, tmp_path_factory) -> Path:
    """A finished run of 2 steps with checkpoint-2."""
    out = tmp_path_factory.mktemp("finished") / "out"
    assert _run(workspace, out, "--max-steps", "2", "--save-steps", "2") == 0
    return out


@pytest.fixture
def checkpoint(finished, tmp_path) -> Path:
    """A private copy of the finished run's checkpoint-2, free to damage."""
    return Path(shutil.copytree(finished / "checkpoints" / "checkpoint-2", tmp_path / "checkpoint-2"))


def test_resume_refuses_to_overwrite_a_saved_model_without_a_checkpoint(workspace, tmp_path, capsys):
    out = tmp_path / "out"
    assert _run(workspace, out, "--max-steps", "1", "--save-steps", "0") == 0
    before = _digest(out / "model.safetensors")
    capsys.readouterr()
    status = _run(workspace, out, "--max-steps", "2", "--save-steps", "0", "--resume")
    line = _error_line(capsys.readouterr().err)
    assert status == 2 and "holds a saved model" in line and "no complete checkpoint" in line, line
    assert all(way in line for way in ("another --output-dir", "--resume-from")), line
    assert _digest(out / "model.safetensors") == before
    assert _global_step(out) == 1


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ("ratio 4", "compression_ratio: checkpoint 2.0, this run 4.0"),
        ("dlcm", "model_type: checkpoint 'conceptmoe', this run 'dlcm'"),
        ("wider", "hidden_size: checkpoint 32, this run 48"),
    ],
)
def test_resume_from_a_checkpoint_of_another_config_is_refused_naming_the_fields(
    workspace, finished, tmp_path, capsys, config, named
):
    out = tmp_path / "out"
    checkpoint = finished / "checkpoints" / "checkpoint-2"
    status = _run(workspace, out, "--max-steps", "4", "--resume-from", str(checkpoint), config=config)
    line = _error_line(capsys.readouterr().err)
    assert status == 2 and str(checkpoint) in line and named in line, line
    assert not out.exists()


def test_a_full_checkpoint_under_lora_is_refused(workspace, finished, tmp_path, capsys):
    checkpoint = finished / "checkpoints" / "checkpoint-2"
    status = _run(workspace, tmp_path / "out", "--max-steps", "4", "--resume-from", str(checkpoint), "--lora")
    line = _error_line(capsys.readouterr().err)
    assert status == 2 and "holds full-model weights, but --lora trains adapters" in line, line


def test_a_step_target_below_the_checkpoint_is_refused_and_at_it_trains_nothing(
    workspace, finished, tmp_path, capsys
):
    out = Path(shutil.copytree(finished, tmp_path / "out"))
    before = _digest(out / "model.safetensors")
    status = _run(workspace, out, "--max-steps", "1", "--save-steps", "2", "--resume")
    line = _error_line(capsys.readouterr().err)
    assert status == 2 and "--max-steps 1 is below the step of" in line and "checkpoint-2 (2)" in line, line
    assert "--max-steps 2 to only save its model, or above 2" in line, line
    assert _digest(out / "model.safetensors") == before and _global_step(out) == 2
    # At the checkpoint's step: nothing is trained (how a run killed while saving its model is finished).
    assert _run(workspace, out, "--max-steps", "2", "--save-steps", "2", "--resume") == 0
    assert "is already at step 2, nothing is left to train" in capsys.readouterr().err
    assert _digest(out / "model.safetensors") == before and _global_step(out) == 2
    # Beyond it: exactly the steps up to the target.
    assert _run(workspace, out, "--max-steps", "3", "--save-steps", "2", "--resume") == 0
    assert _global_step(out) == 3


def test_a_checkpoint_with_nan_weights_is_named_with_its_tensors(workspace, checkpoint, tmp_path, capsys):
    tensors = load_file(checkpoint / "model.safetensors")
    name = sorted(tensors)[3]
    tensors[name][0] = float("nan")
    save_file(tensors, str(checkpoint / "model.safetensors"), metadata={"format": "pt"})
    status = _run(workspace, tmp_path / "out", "--max-steps", "4", "--resume-from", str(checkpoint))
    line = _error_line(capsys.readouterr().err)
    assert status == 2 and str(checkpoint) in line and f"model.safetensors: {name}" in line, line
    assert "NaN or inf" in line and "learning rate" not in line, line


def test_a_garbage_safetensors_header_is_a_problem_not_a_memory_error(
    workspace, checkpoint, tmp_path, capsys
):
    weights = checkpoint / "model.safetensors"
    weights.write_bytes(b"this is not a safetensors file at all " * 10)
    problem = safetensors_problem(weights)
    assert problem is not None and problem.startswith("model.safetensors is not a valid safetensors file")
    # A length field that claims more than the file holds, then valid-looking JSON.
    weights.write_bytes((2**40).to_bytes(8, "little") + b"{}")
    assert "does not fit a file of 10 bytes" in safetensors_problem(weights)
    status = _run(workspace, tmp_path / "out", "--max-steps", "4", "--resume-from", str(checkpoint))
    line = _error_line(capsys.readouterr().err)
    assert status == 2 and "is not a complete checkpoint: model.safetensors is not a valid" in line, line


def test_a_truncated_optimizer_state_is_named(workspace, checkpoint, tmp_path, capsys):
    optimizer = checkpoint / "optimizer.pt"
    optimizer.write_bytes(optimizer.read_bytes()[: optimizer.stat().st_size // 2])
    assert checkpoint_problems(checkpoint) == [
        "optimizer.pt is cut short or not a torch.save file (no zip central directory)"
    ]
    status = _run(workspace, tmp_path / "out", "--max-steps", "4", "--resume-from", str(checkpoint))
    line = _error_line(capsys.readouterr().err)
    assert status == 2 and "optimizer.pt is cut short" in line, line


def _fill_disk_while_saving_the_optimizer_of(step: int, monkeypatch) -> None:
    """torch.save of checkpoint-`step`'s optimizer writes part of the file, then fails as torch does on a
    full disk."""
    original = torch.save

    def save(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)) and str(f).endswith(f"checkpoint-{step}/optimizer.pt"):
            Path(f).write_bytes(b"PK\x03\x04 partial")
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 1536 vs 1420")
        return original(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)


def test_a_full_disk_while_saving_a_checkpoint_leaves_nothing_half_written(
    workspace, tmp_path, capsys, monkeypatch
):
    out = tmp_path / "out"
    _fill_disk_while_saving_the_optimizer_of(2, monkeypatch)
    status = _run(workspace, out, "--max-steps", "3", "--save-steps", "1")
    line = _error_line(capsys.readouterr().err)
    assert status == 1 and "could not write checkpoint-2 into" in line, line
    assert "unexpected pos" in line and "MiB free" in line and "checkpoint-1" in line, line
    assert "free space" in line and "--resume" in line, line
    checkpoints = out / "checkpoints"
    assert sorted(
        path.name for path in checkpoints.iterdir() if path.name.startswith(("checkpoint", "."))
    ) == ["checkpoint-1"]
    assert checkpoint_problems(checkpoints / "checkpoint-1") == []
    assert not (out / ".final-staging").exists() and not (out / "config.json").exists()


def test_a_full_disk_while_saving_the_final_model_leaves_nothing_half_written(
    workspace, tmp_path, capsys, monkeypatch
):
    from transformers import PreTrainedModel

    def save_pretrained(self, folder, *args, **kwargs):
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "model.safetensors").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device", str(Path(folder) / "model.safetensors"))

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", save_pretrained)
    out = tmp_path / "out"
    status = _run(workspace, out, "--max-steps", "1", "--save-steps", "0")
    line = _error_line(capsys.readouterr().err)
    assert status == 1 and "could not write the final model into" in line, line
    assert "no space left on device" in line and "free space" in line, line
    assert not (out / ".final-staging").exists() and not (out / "model.safetensors").exists()


# ------------------------------------------------------------------------------------- read-only folders


def _writes_are_refused(folder: Path) -> bool:
    try:
        (folder / "probe").write_text("x")
    except PermissionError:
        return True
    (folder / "probe").unlink()
    return False


def _refuse_writes_under(folder: Path, monkeypatch) -> None:
    """What a read-only file system does to writes under `folder`, for a root process (which chmod does
    not stop): os.mkdir / os.open for writing / renames / open(..., "w") raise EROFS."""
    folder = folder.resolve()

    def inside(path) -> bool:
        path = Path(os.fsdecode(path)).absolute()
        return path == folder or folder in path.parents

    def refuse(path):
        raise OSError(errno.EROFS, "Read-only file system", os.fsdecode(path))

    originals = {name: getattr(os, name) for name in ("mkdir", "open", "replace", "rename")}
    writing = os.O_WRONLY | os.O_RDWR | os.O_CREAT

    def mkdir(path, *args, **kwargs):
        return refuse(path) if inside(path) else originals["mkdir"](path, *args, **kwargs)

    def os_open(path, flags, *args, **kwargs):
        return (
            refuse(path)
            if inside(path) and flags & writing
            else originals["open"](path, flags, *args, **kwargs)
        )

    def rename(name):
        def moved(src, dst, *args, **kwargs):
            if inside(src) or inside(dst):
                refuse(dst)
            return originals[name](src, dst, *args, **kwargs)

        return moved

    real_open = builtins.open

    def file_open(path, mode="r", *args, **kwargs):
        if isinstance(path, (str, os.PathLike)) and inside(path) and set(mode) & set("wax+"):
            refuse(path)
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(os, "replace", rename("replace"))
    monkeypatch.setattr(os, "rename", rename("rename"))
    monkeypatch.setattr(builtins, "open", file_open)
    monkeypatch.setattr(io, "open", file_open)


@pytest.fixture
def read_only(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    if not _writes_are_refused(folder):
        _refuse_writes_under(folder, monkeypatch)
    yield folder
    folder.chmod(0o755)


def _only_line(capsys) -> str:
    return _error_line(capsys.readouterr().err)


def test_train_into_a_read_only_folder_says_so_in_one_line(workspace, read_only, capsys):
    out = read_only / "out"
    status = _run(workspace, out, "--max-steps", "1")
    line = _only_line(capsys)
    assert status == 2 and f"cannot write --output-dir={str(out)!r}" in line, line
    assert "choose a --output-dir you can write to" in line, line
    assert list(read_only.iterdir()) == []


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny Llama source folder and a 2-stream Hidden Decoding checkpoint converted from it."""
    from hf_concept.conversion import convert_to_hidden_decoding

    root = tmp_path_factory.mktemp("sources")
    llama = tiny_llama_folder(root / "llama")
    return llama, convert_to_hidden_decoding(llama, root / "two-streams", num_streams=2)


@pytest.mark.parametrize("command", ["convert conceptmoe", "convert hidden-decoding", "expand"])
def test_convert_and_expand_into_a_read_only_folder_say_so_in_one_line(sources, read_only, capsys, command):
    llama, two_streams = sources
    dst = read_only / "dst"
    argv = {
        "convert conceptmoe": [
            "convert",
            "conceptmoe",
            llama,
            dst,
            "--encoder-layers=1",
            "--decoder-layers=1",
        ],
        "convert hidden-decoding": ["convert", "hidden-decoding", llama, dst, "--streams", "2"],
        "expand": ["expand", two_streams, dst, "--streams", "4"],
    }[command]
    status = cli.main([str(arg) for arg in argv])
    line = _only_line(capsys)
    assert status == 2 and f"cannot write DST={str(dst)!r}" in line, line
    assert "choose a DST you can write to" in line, line
    assert list(read_only.iterdir()) == []
