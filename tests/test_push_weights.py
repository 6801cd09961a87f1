"""`hf-concept push` refuses weights that would not load or hold NaN, and names every symbolic link.

A truncated or garbage `model.safetensors`, a cut-short shard of a sharded checkpoint, a cut-short
`pytorch_model.bin` and NaN weights (either format) all exit 2 with one line naming the file, in
`--dry-run` too, and nothing reaches the (recording) Hub. A symbolic link to a file is uploaded with a
note naming link and target, printed before the upload; a link to a folder and a broken link are listed
as not uploaded.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_concept.cli import main
from tests.test_push import SPECS, recorder, save_tiny  # noqa: F401 (recorder is a fixture)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return save_tiny("plain", tmp_path_factory.mktemp("weights") / "ckpt")


@pytest.fixture
def folder(pristine, tmp_path) -> Path:
    return Path(shutil.copytree(pristine, tmp_path / "ckpt", symlinks=True))


def push(capsys, folder: Path, *flags: str) -> tuple[int, str, list[str]]:
    capsys.readouterr()
    status = main(["push", str(folder), "org/tiny", *flags])
    captured = capsys.readouterr()
    return status, captured.out, [line for line in captured.err.splitlines() if line.strip()]


def assert_refused(capsys, recorder, folder: Path, *needles: str) -> None:  # noqa: F811
    for flags in (["--dry-run"], []):
        status, out, err = push(capsys, folder, *flags)
        assert status == 2 and len(err) == 1, (flags, err)
        assert err[0].startswith("hf-concept push: error: checkpoint "), err
        for needle in needles:
            assert needle in err[0], (needle, err)
        assert "dry run" not in out and "pushed" not in out
    assert recorder.instances == []


def test_a_truncated_or_garbage_safetensors_file_is_refused(capsys, recorder, folder):  # noqa: F811
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    assert_refused(capsys, recorder, folder, "model.safetensors has", "its header needs", "would not load")
    weights.write_bytes(os.urandom(4096))
    assert_refused(capsys, recorder, folder, "model.safetensors", "would not load")


def test_a_truncated_shard_is_refused(capsys, recorder, tmp_path):  # noqa: F811
    spec = SPECS["plain"]
    folder = tmp_path / "sharded"
    spec.model_class()(spec.make_config()).save_pretrained(folder, max_shard_size="20KB")
    shard = sorted(folder.glob("model-*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-100])
    assert_refused(capsys, recorder, folder, shard.name, "would not load")


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_nan_weights_are_refused_naming_the_tensor(capsys, recorder, folder, fmt):  # noqa: F811
    state = load_file(folder / "model.safetensors")
    name = next(key for key, tensor in state.items() if tensor.is_floating_point() and tensor.numel() > 1)
    state[name] = state[name].clone()
    state[name].view(-1)[1] = float("nan")
    if fmt == "safetensors":
        save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
        file_name = "model.safetensors"
    else:
        (folder / "model.safetensors").unlink()
        torch.save(state, folder / "pytorch_model.bin")
        file_name = "pytorch_model.bin"
    assert_refused(capsys, recorder, folder, f"{file_name}: tensor {name!r} holds NaN or inf", "NaN outputs")


def test_a_cut_short_pytorch_bin_is_refused(capsys, recorder, folder):  # noqa: F811
    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    data = (folder / "pytorch_model.bin").read_bytes()
    (folder / "pytorch_model.bin").write_bytes(data[: len(data) // 2])
    assert_refused(capsys, recorder, folder, "pytorch_model.bin could not be read", "would not load")


def test_symbolic_links_are_named_before_the_upload(capsys, recorder, folder, tmp_path):  # noqa: F811
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / "notes.txt"
    secret.write_text("not meant for the Hub")
    # The weights moved out of the folder and linked back (as an HF cache snapshot does).
    (folder / "model.safetensors").rename(outside / "weights.safetensors")
    (folder / "model.safetensors").symlink_to(outside / "weights.safetensors")
    (folder / "notes.txt").symlink_to(secret)
    (folder / "data").symlink_to(outside, target_is_directory=True)
    (folder / "dangling.json").symlink_to(outside / "absent.json")
    status, out, err = push(capsys, folder, "--dry-run")
    assert status == 0 and err == []
    link_note = f"note: notes.txt is a symbolic link to {secret.resolve()}: that file's content is uploaded"
    weights_note = (
        f"note: model.safetensors is a symbolic link to {(outside / 'weights.safetensors').resolve()}"
    )
    assert link_note in out and weights_note in out
    assert f"not uploaded: data/ (symbolic link to the folder {outside.resolve()}, not followed)" in out
    assert f"not uploaded: dangling.json (broken symbolic link to {outside / 'absent.json'})" in out

    status, out, err = push(capsys, folder)
    assert status == 0 and err == []
    assert out.index(link_note) < out.index("pushed")
    (api,) = recorder.instances
    assert {"model.safetensors", "notes.txt"} <= set(api.uploaded)
    assert not any(path.startswith("data/") or path == "dangling.json" for path in api.uploaded)
