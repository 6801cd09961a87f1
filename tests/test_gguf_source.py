"""GGUF sources of `hf-concept convert` and `hf-concept train` (`hf_concept.conversion.gguf_source`).

Without the gguf package (CI installs `.[dev]` only): which paths are GGUF sources, and the one-line errors
for a folder of several GGUF files, a missing gguf package and a destination that holds the file. With it:
a tiny llama GGUF, written with the package's own writer, converted and trained end to end.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from hf_concept import cli
from hf_concept.conversion.gguf_source import INSTALL_HINT, find_gguf

PROMPT = "the theme then the tether"


def _run(capsys, *argv) -> tuple[int, str]:
    status = cli.main([str(arg) for arg in argv])
    return status, capsys.readouterr().err


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


def test_find_gguf_rules(tmp_path):
    single = tmp_path / "single"
    single.mkdir()
    (single / "model.Q4_1.gguf").write_bytes(b"GGUF")
    (single / "__init__.py").write_text("")
    assert find_gguf(single) == single / "model.Q4_1.gguf"
    assert find_gguf(single / "model.Q4_1.gguf") == single / "model.Q4_1.gguf"
    assert find_gguf(single / "__init__.py") is None
    # A folder with config.json is a safetensors source unless a GGUF file is named.
    (single / "config.json").write_text("{}")
    assert find_gguf(single) is None
    assert find_gguf(single, "model.Q4_1.gguf") == single / "model.Q4_1.gguf"
    with pytest.raises(ValueError, match=r"--gguf-file='other.gguf' is not a \.gguf file in .*model\.Q4_1"):
        find_gguf(single, "other.gguf")
    with pytest.raises(ValueError, match="already a file"):
        find_gguf(single / "model.Q4_1.gguf", "other.gguf")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert find_gguf(empty) is None
    assert find_gguf(tmp_path / "missing") is None


def test_several_gguf_files_are_listed_in_one_line(tmp_path, capsys):
    source = tmp_path / "src"
    source.mkdir()
    for name in ("a.Q4_1.gguf", "b.Q8_0.gguf"):
        (source / name).write_bytes(b"GGUF")
    dst = tmp_path / "dst"
    status, err = _run(capsys, "convert", "conceptmoe", source, dst, "--ratio", "1", "--chunking", "fixed")
    line = _one_line(err)
    assert status == 2
    assert "a.Q4_1.gguf, b.Q8_0.gguf" in line and "--gguf-file NAME" in line, line
    assert not dst.exists()
    status, err = _run(capsys, "train", source, "--data", source / "a.Q4_1.gguf", "--output-dir", dst)
    assert status == 2 and "--gguf-file NAME" in _one_line(err)
    assert not dst.exists()


def test_missing_gguf_package_names_the_extra(tmp_path, capsys, monkeypatch):
    # None in sys.modules makes `import gguf` raise ImportError, whether or not it is installed.
    monkeypatch.setitem(sys.modules, "gguf", None)
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF")
    dst = tmp_path / "dst"
    status, err = _run(capsys, "convert", "hidden-decoding", source, dst, "--streams", "1")
    line = _one_line(err)
    assert status == 2 and INSTALL_HINT in line and str(source) in line, line
    assert not dst.exists()
    status, err = _run(capsys, "train", source, "--data", source, "--output-dir", dst)
    assert status == 2 and INSTALL_HINT in _one_line(err)
    assert not dst.exists()


def test_destination_holding_the_gguf_is_refused(tmp_path, capsys):
    source = tmp_path / "models" / "model.gguf"
    source.parent.mkdir()
    source.write_bytes(b"GGUF")
    argv = ("convert", "conceptmoe", source, tmp_path / "models", "--overwrite")
    status, err = _run(capsys, *argv)
    assert status == 2 and "contains the source" in _one_line(err)
    assert source.read_bytes() == b"GGUF"


def write_tiny_gguf(path: Path, hidden: int = 32, layers: int = 3, heads: int = 4, kv_heads: int = 2) -> None:
    """A llama GGUF with random float32 weights, tied embeddings (no `output.weight`), a byte-level BPE
    vocabulary with four merges, and an apache-2.0 licence."""
    import gguf
    import numpy as np
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = ["<|endoftext|>", "<|im_start|>", *bytes_to_unicode().values(), "th", "the", "Ġt", "Ġthe"]
    generator = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(128)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(2 * hidden)
    writer.add_embedding_length(hidden)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_license("apache-2.0")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3] + [1] * (len(tokens) - 2))
    writer.add_token_merges(["t h", "th e", "Ġ t", "Ġ the"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(0)
    head_dim = hidden // heads
    shapes = {"token_embd": (len(tokens), hidden), "output_norm": (hidden,)}
    for layer in range(layers):
        shapes |= {
            f"blk.{layer}.attn_norm": (hidden,),
            f"blk.{layer}.attn_q": (heads * head_dim, hidden),
            f"blk.{layer}.attn_k": (kv_heads * head_dim, hidden),
            f"blk.{layer}.attn_v": (kv_heads * head_dim, hidden),
            f"blk.{layer}.attn_output": (hidden, heads * head_dim),
            f"blk.{layer}.ffn_norm": (hidden,),
            f"blk.{layer}.ffn_gate": (2 * hidden, hidden),
            f"blk.{layer}.ffn_up": (2 * hidden, hidden),
            f"blk.{layer}.ffn_down": (hidden, 2 * hidden),
        }
    for name, shape in shapes.items():
        # Norm weights near 1, matrices small: a model whose logits are not all alike.
        base = 1.0 if len(shape) == 1 else 0.0
        values = base + generator.standard_normal(shape) * (0.1 if len(shape) == 1 else 0.2)
        writer.add_tensor(f"{name}.weight", values.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    pytest.importorskip("gguf", reason="the GGUF round trip needs the gguf package: pip install gguf")
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf"
    write_tiny_gguf(path)
    return path


def _gguf_reference(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name).eval()
    return model, AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.parametrize(
    ("target", "options"),
    [
        (
            "conceptmoe",
            ("--ratio", "1", "--chunking", "fixed", "--encoder-layers", "1", "--decoder-layers", "1"),
        ),
        ("hidden-decoding", ("--streams", "1")),
    ],
)
def test_convert_from_gguf_keeps_model_and_tokenizer(
    tiny_gguf, tmp_path, capsys, monkeypatch, target, options
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    dst = tmp_path / "dst"
    # The folder holds one GGUF file: the folder itself is the source.
    status, err = _run(capsys, "convert", target, tiny_gguf.parent, dst, *options)
    assert status == 0, err
    assert not any((tmp_path / "tmp").iterdir()), "the temporary safetensors folder was left behind"
    reference, reference_tokenizer = _gguf_reference(tiny_gguf)
    tokenizer = AutoTokenizer.from_pretrained(dst)
    batch = tokenizer([PROMPT], return_tensors="pt")
    assert batch.input_ids.tolist() == reference_tokenizer([PROMPT], return_tensors="pt").input_ids.tolist()
    assert batch.input_ids.shape[1] < len(PROMPT), "the GGUF's merges were not applied"
    converted = AutoModelForCausalLM.from_pretrained(dst, trust_remote_code=True).eval()
    with torch.no_grad():
        assert_close(converted(**batch).logits, reference(**batch).logits, atol=1e-5, rtol=0)
    card = (dst / "README.md").read_text()
    assert str(tiny_gguf) in card and "license: apache-2.0" in card


def test_train_from_gguf_saves_a_plain_checkpoint(tiny_gguf, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = tmp_path / "data.txt"
    data.write_text("\n\n".join(f"the theme {index} then the tether, the thing." for index in range(40)))
    out = tmp_path / "out"
    argv = ("train", tiny_gguf, "--data", data, "--output-dir", out, "--max-steps", "2")
    status, err = _run(
        capsys, *argv, "--per-device-train-batch-size", "2", "--block-size", "32", "--save-steps", "0"
    )
    assert status == 0, err
    model = AutoModelForCausalLM.from_pretrained(out)
    reference, reference_tokenizer = _gguf_reference(tiny_gguf)
    assert type(model) is type(reference) and getattr(model.config, "quantization_config", None) is None
    assert not torch.equal(model.model.norm.weight, reference.model.norm.weight), "nothing was trained"
    assert AutoTokenizer.from_pretrained(out)(PROMPT).input_ids == reference_tokenizer(PROMPT).input_ids
    assert str(tiny_gguf) in (out / "README.md").read_text()


def test_truncated_gguf_is_named_in_one_line(tiny_gguf, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny_gguf.read_bytes()[: tiny_gguf.stat().st_size // 2])
    dst = tmp_path / "dst"
    status, err = _run(capsys, "convert", "hidden-decoding", truncated, dst, "--streams", "1")
    line = err.strip().splitlines()[-1]
    assert status == 2 and line.startswith("hf-concept convert hidden-decoding: error: src="), err
    assert str(truncated) in line and "could not be loaded as GGUF" in line
    assert not dst.exists() and not any((tmp_path / "tmp").iterdir())


def test_a_gguf_of_another_architecture_is_named_in_one_line(tmp_path, capsys):
    """A GPT-2 GGUF: one line naming the file, its architecture and the supported ones; nothing written."""
    gguf = pytest.importorskip("gguf", reason="needs the gguf package: pip install gguf")
    import numpy as np

    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_context_length(64)
    writer.add_block_count(1)
    writer.add_embedding_length(8)
    writer.add_head_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    dst = tmp_path / "dst"
    status, err = _run(capsys, "convert", "hidden-decoding", path, dst, "--streams", "1")
    line = err.strip().splitlines()[-1]
    assert status == 2 and len(err.strip().splitlines()) == 1, err
    assert str(path) in line and "'gpt2'" in line and "llama, mistral, qwen2" in line, line
    assert not dst.exists()
