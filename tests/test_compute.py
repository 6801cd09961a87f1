"""The per-token compute calculator (hf_concept.compute, `hf-concept compute`): against a hand count on a
tiny config, exact parameter counts, the identity case (fixed R = 1: the source's compute), and what each
§3.5 lever changes."""

from __future__ import annotations

import pytest

from hf_concept.cli import main
from hf_concept.compute import conceptmoe_compute, source_config_of
from hf_concept.modeling.configuration_conceptmoe import ConceptMoEConfig
from hf_concept.modeling.modeling_conceptmoe import ConceptMoEForCausalLM
from hf_concept.modeling.modeling_plain import PlainDecoderForCausalLM
from tests.conformance.families import _conceptmoe_config

# d 32, 4 heads (2 KV) of 8, MLP 64, vocab 97, 5 layers: 2 encoder, 1 concept, 2 decoder.
ATTENTION = 32 * 32 + 2 * 32 * 16 + 32 * 32  # q, k, v (2 KV heads of 8), o
MLP = 3 * 32 * 64
HEAD = 97 * 32


def test_fixed_chunking_at_ratio_one_costs_what_its_source_costs():
    config = _conceptmoe_config(chunking="fixed", compression_ratio=1, joint_decoding_layers=0)
    report, source = conceptmoe_compute(config, context_length=64)
    assert source.matmul_flops == 2 * (5 * (ATTENTION + MLP) + HEAD)
    assert (report.matmul_flops, report.attention_flops) == (source.matmul_flops, source.attention_flops)
    # Attention: 4 · 4 heads · 8 · 64 keys per layer, 5 layers.
    assert source.attention_flops == 5 * 4 * 4 * 8 * 64
    # Parameters are the built models' own counts; the unused router (2 · 32²) is the only extra.
    assert report.parameters == ConceptMoEForCausalLM(config).num_parameters()
    assert source.parameters == PlainDecoderForCausalLM(source_config_of(config)).num_parameters()
    assert report.parameters - source.parameters == 2 * 32 * 32


def test_each_reallocation_lever_moves_the_right_term():
    base = dict(chunking="fixed", compression_ratio=2, joint_decoding_layers=0)
    report, source = conceptmoe_compute(_conceptmoe_config(**base), context_length=64)
    # R = 2: the one concept layer runs on half the tokens, and reads half the keys.
    assert source.matmul_flops - report.matmul_flops == (ATTENTION + MLP)
    assert source.attention_flops - report.attention_flops == pytest.approx(4 * 4 * 8 * 64 * (1 - 1 / 4))
    looped, _ = conceptmoe_compute(_conceptmoe_config(**base, concept_loop=[0, 1, 2]), context_length=64)
    # Two extra passes of the concept layer, each on half the tokens.
    assert looped.matmul_flops - report.matmul_flops == 2 * (ATTENTION + MLP)
    assert looped.parameters == report.parameters
    moe = dict(base, num_experts=4, num_experts_per_tok=1, moe_intermediate_size=16)
    one, moe_source = conceptmoe_compute(_conceptmoe_config(**moe), context_length=64)
    three, _ = conceptmoe_compute(_conceptmoe_config(**moe, concept_num_experts_per_tok=3), context_length=64)
    expert = 3 * 32 * 16
    # Top-3 in the concept layer: two more experts on half the tokens; parameters unchanged.
    assert three.matmul_flops - one.matmul_flops == 2 * 2 * expert / 2
    assert three.parameters == one.parameters and three.active_parameters - one.active_parameters == expert
    # Against the source, active parameters count one expert of four per MoE layer.
    assert moe_source.parameters - moe_source.active_parameters == 5 * 3 * expert + 97 * 32


def test_cli_prints_the_table_with_ratios(tmp_path, capsys):
    _conceptmoe_config(compression_ratio=2.0).save_pretrained(tmp_path)
    assert main(["compute", str(tmp_path), "--context", "128"]) == 0
    output = capsys.readouterr().out
    lines = {line.split("  ")[0].strip(): line.split() for line in output.splitlines()[1:]}
    assert set(lines) == {
        "parameters (M)",
        "active parameters per token (M)",
        "matmul GFLOP per token",
        "attention GFLOP per token at L=128",
        "total GFLOP per token",
    }
    report, source = conceptmoe_compute(ConceptMoEConfig.from_pretrained(tmp_path), context_length=128)
    assert float(lines["total GFLOP per token"][-1]) == pytest.approx(report.flops / source.flops, abs=1e-3)
    plain = tmp_path / "plain.json"
    plain.write_text('{"model_type": "llama"}')
    assert main(["compute", str(plain)]) == 2
    assert "compute needs 'conceptmoe'" in capsys.readouterr().err
