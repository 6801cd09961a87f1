"""Keeps the trained-router benchmark from rotting: `train_conceptmoe_router.py --quick` writes a pair of
folders that load, and `bench_conceptmoe.py --trained` times them on text and prints the trained row."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from hf_concept.modeling.modeling_conceptmoe import ConceptMoEForCausalLM
from hf_concept.modeling.transformers_compat import cache_kwarg
from tests.benchmark_scripts import load_benchmark


def test_quick_training_writes_loadable_folders_and_the_bench_prints_the_trained_row(tmp_path, capsys):
    out = tmp_path / "router"
    result = load_benchmark("train_conceptmoe_router").main([str(out), "--quick", "--threads", "1"])
    assert sorted(entry.name for entry in out.iterdir()) == ["conceptmoe", "source", "training.json"]
    # Nothing else is left next to OUT (the staging folder is renamed into place).
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["router"]
    source = LlamaForCausalLM.from_pretrained(out / "source")
    trained = ConceptMoEForCausalLM.from_pretrained(out / "conceptmoe")
    config = trained.config
    assert (config.chunking, config.compression_ratio, config.ratio_scope) == ("dynamic", 2.0, "batch")
    assert config.num_hidden_layers == source.config.num_hidden_layers
    for folder in ("source", "conceptmoe"):
        assert (
            len(AutoTokenizer.from_pretrained(out / folder)) == config.vocab_size == source.config.vocab_size
        )
    recorded = json.loads((out / "training.json").read_text(encoding="utf-8"))
    assert recorded["conceptmoe"]["heldout"] == result["conceptmoe"]["heldout"]
    assert len(recorded["conceptmoe"]["history"]) == recorded["args"]["router_steps"]
    assert math.isfinite(result["conceptmoe"]["heldout"]["inference_ratio"])
    assert "realised inference ratio" in capsys.readouterr().out

    bench = load_benchmark("bench_conceptmoe")
    tiny = f"--trained {out} --chunking none --seq-lens 64,96 --decode-tokens 4 --repeats 1 --threads 1"
    for decode, extra in (("text", " --profile"), ("greedy", "")):
        figures = bench.main(f"{tiny} --trained-decode {decode}{extra}".split())
        printed = capsys.readouterr().out
        assert "[trained dynamic router, target R=2]" in printed
        assert "exactness: trained model's cached greedy decode" in printed
        assert "prompts: the corpus validation split" in printed
        assert "targets (trained):" in printed and "decode >= 1.5x at L=96" in printed
        assert ("profile [trained]" in printed) == (decode == "text")
        assert set(figures) == {"trained"}
        assert [row["length"] for row in figures["trained"]] == [64, 96]
        for row in figures["trained"]:
            assert math.isfinite(row["realised"]) and row["realised"] >= 1
            assert 1 <= row["decode_realised"] <= 4
            assert row["prefill"] > 0 and row["decode"] > 0 and row["kv"] > 0


def test_training_refuses_a_non_empty_out_without_overwrite(tmp_path):
    out = tmp_path / "router"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit) as raised:
        load_benchmark("train_conceptmoe_router").main([str(out), "--quick"])
    assert raised.value.code == 2
    assert [entry.name for entry in out.iterdir()] == ["keep.txt"]
    assert [entry.name for entry in tmp_path.iterdir()] == ["router"]


def test_bench_refuses_chunking_none_without_a_trained_folder(tmp_path):
    bench = load_benchmark("bench_conceptmoe")
    with pytest.raises(ValueError, match="--chunking none"):
        bench.parse_args(["--chunking", "none"])
    with pytest.raises(ValueError, match=r"source/config\.json"):
        bench.parse_args(["--trained", str(tmp_path)])


def test_cached_decode_check_fails_when_the_cache_disagrees():
    """The trained row's exactness check can fail: a model whose cached step differs from its full forward."""
    bench = load_benchmark("bench_conceptmoe")

    class Drifting(torch.nn.Module):
        def forward(self, input_ids, use_cache=False, logits_to_keep=0, **cache):
            logits = torch.nn.functional.one_hot(input_ids % 5, 5).float()  # (1, L, 5)
            if any(value is not None for value in cache.values()):
                logits = logits + 1e-2
            return SimpleNamespace(logits=logits, **cache_kwarg(object()))

    with pytest.raises(AssertionError):
        bench.check_cached_decode(Drifting(), torch.tensor([[1, 2, 3]]), steps=2)
