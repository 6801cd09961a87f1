"""The FLOPs / parameters / KV planner (hf_concept.planning, `hf-concept plan`) against figures counted by
hand, against real models' parameter counts, and the search against a brute-force enumeration."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
import torch

from hf_concept import planning
from hf_concept.cli import main
from hf_concept.modeling.configuration_dlcm import DLCMConfig
from hf_concept.modeling.configuration_plain import PlainDecoderConfig
from hf_concept.modeling.modeling_dlcm import DLCMForCausalLM
from hf_concept.modeling.modeling_plain import PlainDecoderForCausalLM

# Hand-computed figures are exact in binary floating point; the tolerance only guards summation order.
EXACT = dict(rtol=1e-12, atol=0.0)
PAPER_BASELINE = "dlcm-paper-baseline-1.3b"
PAPER_DLCM = "dlcm-paper-2.3b"


def assert_float(actual: float, expected: float) -> None:
    torch.testing.assert_close(
        torch.tensor(actual, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64), **EXACT
    )


def tiny_llama(**overrides) -> planning.BaselineSpec:
    fields = dict(
        vocab_size=100,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=4,
        intermediate_size=40,
    )
    return planning.BaselineSpec(**{**fields, **overrides})


def tiny_dlcm(**overrides) -> planning.DLCMSpec:
    fields = dict(
        vocab_size=50,
        hidden_size=8,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        intermediate_size=16,
        encoder_layers=1,
        concept_layers=2,
        decoder_layers=1,
        concept_hidden_size=16,
        concept_num_attention_heads=4,
        concept_num_key_value_heads=2,
        concept_head_dim=4,
        concept_intermediate_size=32,
        cross_num_attention_heads=2,
        cross_num_key_value_heads=1,
        cross_head_dim=4,
        compression_ratio=4.0,
    )
    return planning.DLCMSpec(**{**fields, **overrides})


def test_tiny_llama_by_hand():
    spec = tiny_llama()
    # One layer: q 16x16, k and v 16x(2 heads x 4), o 16x16; MLP gate/up/down 16x40 each; two norms of 16.
    attention = 16 * 16 + 2 * 16 * 8 + 16 * 16  # 768
    mlp = 3 * 16 * 40  # 1920
    layer = attention + mlp + 2 * 16  # 2720
    embedding = 100 * 16  # 1600, and an untied LM head of the same size
    assert planning.parameter_count(spec) == 2 * layer + embedding + 16 + embedding == 8656
    assert planning.parameter_count(spec, exclude_embeddings=True) == 2 * layer + 16 == 5456
    assert planning.parameter_count(tiny_llama(tie_word_embeddings=True)) == 8656 - 1600

    # Decoding at L = 8: 2 FLOPs per weight for the layers and the LM head, 4 x H x K per key per layer.
    matmul = 2 * (2 * (attention + mlp) + embedding)  # 13952
    attention_map = 2 * (4 * 4 * 4 * 8)  # 1024
    assert_float(planning.inference_flops_per_token(spec, 8), matmul + attention_map)
    assert_float(planning.inference_flops_per_token(spec, 8, include_attention=False), matmul)
    # Training: 3 x forward, each query reading (8 + 1) / 2 keys on average.
    assert_float(planning.training_flops_per_token(spec, 8), 3 * (matmul + 2 * (4 * 4 * 4 * 4.5)))
    # KV: 2 layers x (K, V) x 2 KV heads x head dim 4 entries, 2 bytes each.
    assert_float(planning.kv_cache_bytes_per_token(spec, 2), 2 * 2 * 2 * 4 * 2)
    assert_float(planning.kv_cache_bytes_per_token(spec, 4), 2 * 2 * 2 * 4 * 4)


def test_tiny_dlcm_by_hand():
    spec = tiny_dlcm(smoothing="linear")
    token_attention = 8 * 8 + 2 * 8 * 4 + 8 * 8  # q, k, v (1 KV head of 4), o at d_token 8: 192
    token_mlp = 3 * 8 * 16  # 384
    concept_attention = 16 * 16 + 2 * 16 * 8 + 16 * 16  # 4 heads, 2 KV heads of 4, at d_concept 16: 768
    concept_mlp = 3 * 16 * 32  # 1536
    cross = 8 * 8 + 2 * 16 * 4 + 8 * 8  # Q from d_token, K/V from d_concept (1 KV head), O: 256
    groups = {
        "model.embed_tokens": 50 * 8,
        "model.encoder_layers": token_attention + token_mlp + 2 * 8,
        "model.chunker": 2 * 8 * 8,
        "model.concept_in_proj": 16 * 8,
        "model.null_concept": 16,
        "model.concept_layers": 2 * (concept_attention + concept_mlp + 2 * 16),
        "model.concept_norm": 16,
        "model.smoothing": 16 * 16,
        # self-attention, MLP, three norms of 8, cross projections and its q/k norms over the head dim 4.
        "model.decoder_layers": token_attention + token_mlp + 3 * 8 + cross + 2 * 4,
        "model.norm": 8,
        "lm_head": 50 * 8,
    }
    assert planning.parameter_groups(spec) == groups
    assert planning.parameter_count(spec) == 7480
    assert_float(planning.concept_share(spec), (4672 + 16) / 7480)
    assert_float(planning.concept_share(spec, of="non_embedding"), (4672 + 16) / (7480 - 800))
    assert planning.parameter_groups(tiny_dlcm(router="rule"))["model.chunker"] == 0
    # The default "ema" smoothing has no W_s: 16 x 16 fewer parameters and matmul FLOPs per concept.
    assert planning.parameter_count(tiny_dlcm()) == 7480 - 16 * 16
    assert_float(
        planning.inference_flops_per_token(spec, 8) - planning.inference_flops_per_token(tiny_dlcm(), 8),
        2 * 16 * 16 / 4,
    )

    # Per token: encoder, router, decoder (self + MLP + cross Q/O), LM head; per concept (/4): W_up, the
    # concept layers, smoothing and the cross K/V projections.
    per_token = (token_attention + token_mlp) + 2 * 8 * 8 + (token_attention + token_mlp + 2 * 8 * 8) + 400
    per_concept = 16 * 8 + 2 * (concept_attention + concept_mlp) + 16 * 16 + 2 * 16 * 4
    matmul = 2 * (per_token + per_concept / 4)  # 6176
    # Decoding at L = 8 (M = 2 concepts): encoder and decoder self-attention read 8 keys (2 heads of 4);
    # the concept layers (4 heads of 4, run 1/4 per token) and the cross-attention (2 heads) read 2.
    decode_map = 2 * (4 * 2 * 4 * 8) + 2 * (4 * 4 * 4 * 2) / 4 + 4 * 2 * 4 * 2  # 640
    assert_float(planning.inference_flops_per_token(spec, 8), matmul + decode_map)
    assert_float(planning.inference_flops_per_token(spec, 8, include_attention=False), matmul)
    # Training means: 4.5 token keys, 1.5 concepts; the cross-attention replicated (4.5) or counted (1.5).
    self_map = 2 * (4 * 2 * 4 * 4.5) + 2 * (4 * 4 * 4 * 1.5) / 4
    replicated = 3 * (matmul + self_map + 4 * 2 * 4 * 4.5)
    counted = 3 * (matmul + self_map + 4 * 2 * 4 * 1.5)
    assert_float(planning.training_flops_per_token(spec, 8), replicated)
    assert_float(planning.training_flops_per_token(spec, 8, cross_attention="counted"), counted)
    assert (replicated, counted) == (19968, 19680)
    # KV entries: encoder + decoder self-attention (2 x 1 x 4 each) per token; concept layers
    # (2 x 2 x 2 x 4) and cross K/V (2 x 1 x 4) per concept.
    assert_float(planning.kv_cache_bytes_per_token(spec, 2), 2 * (2 * 8 + (32 + 8) / 4))


@pytest.mark.parametrize(
    "flags",
    [
        dict(),
        dict(qk_norm=True, tie_word_embeddings=True),
        dict(attention_bias=True, attention_output_bias=True, mlp_bias=True),
    ],
)
def test_parameters_match_real_models(flags):
    plain = PlainDecoderConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, **flags,
    )  # fmt: skip
    model = PlainDecoderForCausalLM(plain)
    assert planning.parameter_count(planning.BaselineSpec.from_config(plain)) == sum(
        parameter.numel() for parameter in model.parameters()
    )
    dlcm = DLCMConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
        encoder_layers=1, concept_layers=2, decoder_layers=2, concept_hidden_size=64,
        concept_num_attention_heads=8, concept_num_key_value_heads=4, cross_num_attention_heads=2,
        cross_num_key_value_heads=1, cross_head_dim=16, **flags,
    )  # fmt: skip
    model = DLCMForCausalLM(dlcm)
    spec = planning.DLCMSpec.from_config(dlcm)
    counts = {name: 0 for name in planning.parameter_groups(spec)}
    for name, parameter in model.named_parameters():
        group = next(prefix for prefix in counts if name == prefix or name.startswith(prefix + "."))
        counts[group] += parameter.numel()
    if flags.get("tie_word_embeddings"):
        counts["lm_head"] = 0
    assert counts == planning.parameter_groups(spec)


def test_transformers_configs_read_with_their_bias_rules():
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    shape = dict(
        vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    for config_class, extra in (
        (LlamaConfig, dict(attention_bias=True)),
        (Qwen2Config, {}),
        (Qwen3Config, {}),
    ):
        config = config_class(**shape, **extra)
        model = AutoModelForCausalLM.from_config(config)
        expected = sum(parameter.numel() for parameter in model.parameters())
        assert planning.parameter_count(planning.BaselineSpec.from_config(config)) == expected, config_class


def test_specs_from_dicts_files_and_folders(tmp_path):
    config = PlainDecoderConfig(
        vocab_size=100, hidden_size=16, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    config.save_pretrained(tmp_path)
    assert planning.BaselineSpec.from_pretrained(tmp_path) == tiny_llama()
    assert planning.BaselineSpec.from_pretrained(tmp_path / "config.json") == tiny_llama()
    assert planning.load_spec(str(tmp_path)) == tiny_llama()
    dlcm = DLCMConfig(**tiny_dlcm().to_dict())
    assert planning.DLCMSpec.from_config(dlcm) == tiny_dlcm()
    dlcm.save_pretrained(tmp_path / "dlcm")
    assert planning.load_spec(tmp_path / "dlcm") == tiny_dlcm()
    # Defaults are DLCMConfig's: concept fields from the token ones, cross head dim = head dim.
    defaults = DLCMConfig(vocab_size=50, hidden_size=8, intermediate_size=16, num_attention_heads=2)
    assert planning.DLCMSpec.from_config(defaults) == planning.DLCMSpec(
        vocab_size=50, hidden_size=8, intermediate_size=16, num_attention_heads=2
    )


BASE_FIELDS = dict(
    vocab_size=100, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=40
)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({**BASE_FIELDS, "vocab_size": None}, "'vocab_size'"),
        ({**BASE_FIELDS, "num_key_value_heads": 3}, "num_key_value_heads=3"),
        ({**BASE_FIELDS, "num_experts": 8}, "num_experts=8"),
        ({**BASE_FIELDS, "sliding_window": 4096}, "sliding_window=4096"),
        ({**BASE_FIELDS, "hidden_size": -16}, "hidden_size=-16"),
    ],
)
def test_bad_baselines_name_the_field(values, message):
    with pytest.raises(ValueError, match=message):
        planning.BaselineSpec.from_dict(values)
    # A Qwen2-style config whose window is switched off is full attention.
    planning.BaselineSpec.from_dict({**BASE_FIELDS, "sliding_window": 4096, "use_sliding_window": False})


def test_bad_dlcm_and_arguments_name_the_value():
    with pytest.raises(ValueError, match="compression_ratio=1"):
        tiny_dlcm(compression_ratio=1)
    with pytest.raises(ValueError, match="concept_num_key_value_heads=3"):
        tiny_dlcm(concept_num_key_value_heads=3)
    with pytest.raises(ValueError, match="context_length=0"):
        planning.inference_flops_per_token(tiny_dlcm(), 0)
    with pytest.raises(ValueError, match="dtype_bytes=0"):
        planning.kv_cache_bytes_per_token(tiny_dlcm(), 0)
    with pytest.raises(ValueError, match="cross_attention='ragged'"):
        planning.training_flops_per_token(tiny_dlcm(), 8, cross_attention="ragged")
    with pytest.raises(ValueError, match=r"target_share=1\.5"):
        planning.search_dlcm(tiny_llama(), 4.0, 1.5)


def test_paper_presets_reproduce_table_3():
    baseline = planning.load_spec(PAPER_BASELINE)
    dlcm = planning.load_spec(PAPER_DLCM)
    # Table 3: a 1.3B baseline and a 2.3B DLCM (2.24B in our reading, see PRESETS) with P = 60% (§6.3).
    assert round(planning.parameter_count(baseline) / 1e9, 1) == 1.3
    assert 2.2e9 < planning.parameter_count(dlcm) < 2.35e9
    assert abs(planning.concept_share(dlcm) - 0.60) < 0.01
    # §7.1: "the effective FLOPs per inference step remain comparable to the smaller baseline".
    ratio = planning.inference_flops_per_token(dlcm) / planning.inference_flops_per_token(baseline)
    assert 0.75 < ratio < 1.0
    assert DLCMConfig(**dlcm.to_dict()).num_hidden_layers == 32


def test_search_returns_matches_within_the_tolerances():
    baseline = planning.load_spec(PAPER_BASELINE)
    tolerance = 0.02
    found = planning.search_dlcm(
        baseline, 4.0, (0.55, 0.65), flops_tolerance=tolerance, token_widths=[1280, 1536], top_k=8
    )
    assert len(found) == 8
    target = planning.inference_flops_per_token(baseline, 4096)
    for candidate in found:
        flops = planning.inference_flops_per_token(candidate.spec, 4096)
        assert abs(flops / target - 1) <= tolerance
        assert_float(candidate.flops_error, flops / target - 1)
        assert 0.55 <= planning.concept_share(candidate.spec) <= 0.65
        assert candidate.spec.hidden_size in (1280, 1536)
        assert candidate.spec.compression_ratio == 4.0
        DLCMConfig(**candidate.spec.to_dict())
    buckets = [int(abs(candidate.flops_error) / (tolerance / 10)) for candidate in found]
    assert buckets == sorted(buckets)


def test_search_finds_the_brute_force_best_match():
    baseline = tiny_llama(num_hidden_layers=6, vocab_size=256)
    tolerance = 0.3
    found = planning.search_dlcm(
        baseline, 2.0, (0.0, 1.0), context_length=32, flops_tolerance=tolerance, token_widths=[16],
        concept_widths=[16, 32], max_token_layers=3, max_concept_layers=12, top_k=10_000,
    )  # fmt: skip
    # Brute force over the same grid through the public functions: per (concept width, encoder, decoder),
    # the concept layer count with the closest inference FLOPs.
    target = planning.inference_flops_per_token(baseline, 32)
    best: dict[tuple[int, int, int], float] = {}
    grid = itertools.product([16, 32], range(1, 4), range(1, 13), range(1, 4))
    for concept_width, encoders, concepts, decoders in grid:
        spec = planning.dlcm_like(baseline, 16, concept_width, (encoders, concepts, decoders), 2.0)
        error = abs(planning.inference_flops_per_token(spec, 32) / target - 1)
        key = (concept_width, encoders, decoders)
        best[key] = min(error, best.get(key, error))
    expected = {key for key, error in best.items() if error <= tolerance}
    matched = {(c.spec.concept_hidden_size, c.spec.encoder_layers, c.spec.decoder_layers) for c in found}
    assert expected and matched == expected
    assert_float(min(abs(candidate.flops_error) for candidate in found), min(best.values()))


def test_cli_prints_the_plan(capsys, tmp_path):
    rc = main(["plan", PAPER_BASELINE, "--ratio", "4", "--concept-share", "0.6", "--dlcm", PAPER_DLCM,
               "--token-widths", "1536", "--top", "3"])  # fmt: skip
    output = capsys.readouterr().out
    assert rc == 0
    for label in ("baseline", "given", "#1", "#3"):
        assert sum(line.startswith(label + " ") for line in output.splitlines()) == 2, label
    assert "#4 " not in output
    assert "0.608" in output  # the given DLCM's P
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dataclasses.asdict(tiny_llama(num_hidden_layers=8))))
    rc = main(["plan", str(path), "--ratio", "2", "--concept-share", "0.3:0.7", "--context", "64"])
    assert rc == 0, capsys.readouterr().err


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["no-such-preset", "--ratio", "4", "--concept-share", "0.6"], "neither a preset"),
        ([PAPER_BASELINE, "--ratio", "1", "--concept-share", "0.6"], "compression_ratio=1.0"),
        ([PAPER_BASELINE, "--ratio", "4", "--concept-share", "most"], "--concept-share='most'"),
        ([PAPER_BASELINE, "--ratio", "4", "--concept-share", "0.6", "--context", "0"], "context_length=0"),
        ([PAPER_BASELINE, "--ratio", "4", "--concept-share", "0.6", "--dlcm", PAPER_BASELINE], "not a DLCM"),
        ([PAPER_DLCM, "--ratio", "4", "--concept-share", "0.6"], "is a DLCM config"),
        (
            [PAPER_BASELINE, "--ratio", "4", "--concept-share", "0.6", "--token-widths", "a,b"],
            "--token-widths",
        ),
    ],
)
def test_cli_user_errors_exit_2_with_one_line(capsys, arguments, message):
    assert main(["plan", *arguments]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], captured.err


def test_cli_without_a_match_exits_1(capsys):
    arguments = [PAPER_BASELINE, "--ratio", "4", "--concept-share", "0.6", "--token-widths", "1536",
                 "--concept-widths", "3072", "--flops-tolerance", "0"]  # fmt: skip
    assert main(["plan", *arguments]) == 1
    assert "no DLCM matched" in capsys.readouterr().err


def _law_file(tmp_path, **overrides) -> str:
    """A main-law file as `fit-scaling --save` writes it, with chosen parameters."""
    from hf_concept.scaling import ScalingLawFit, save_fit

    params = dict(E0=1.7, A_token=400.0, t_token=0.0, delta_1=0.3, A_concept=400.0, gamma=0.2,
                  t_concept=0.0, delta_2=0.3, A_data=400.0, t_data=0.0, alpha=0.3)  # fmt: skip
    params.update(overrides)
    return str(save_fit(ScalingLawFit("main", params, r2=0.99, rows=30), tmp_path / "law.json"))


def _printed_candidates(output: str) -> list[tuple[float, float]]:
    """(R, predicted loss) of the #k rows, in printed order."""
    shapes, costs = output.split("Costs per token")
    ratios = {line.split()[0]: float(line.split()[1]) for line in shapes.splitlines() if line.startswith("#")}
    losses = []
    for line in costs.splitlines():
        if line.startswith("#"):
            losses.append((ratios[line.split()[0]], float(line.split()[-1])))
    return losses


@pytest.mark.parametrize(("gamma", "best_ratio"), [(1.0, 2.0), (-1.0, 8.0)])
def test_plan_ranks_by_the_fitted_law(tmp_path, capsys, gamma, best_ratio):
    law = _law_file(tmp_path, gamma=gamma)
    rc = main(["plan", PAPER_BASELINE, "--law", law, "--train-tokens", "1e12", "--token-widths", "1536",
               "--top", "4"])  # fmt: skip
    output = capsys.readouterr().out
    assert rc == 0
    assert f"Ranked by the fitted law {law}" in output and "R = 2, 4, 8" in output
    printed = _printed_candidates(output)
    assert len(printed) == 4 and [loss for _, loss in printed] == sorted(loss for _, loss in printed)
    # γ > 0 makes compression costly, γ < 0 rewards it: the law's best shape follows it.
    assert printed[0][0] == best_ratio
    # The best printed shape is the best of every FLOPs match at every R of the grid.
    from hf_concept.commands.plan import predicted_loss
    from hf_concept.scaling import load_fit

    fitted = load_fit(law)
    baseline = planning.load_spec(PAPER_BASELINE)
    every = [
        predicted_loss(fitted, candidate.spec, 1e12)
        for ratio in (2.0, 4.0, 8.0)
        for candidate in planning.search_dlcm(baseline, ratio, (0.3, 0.7), token_widths=[1536], top_k=10_000)
    ]
    assert printed[0][1] == pytest.approx(min(every), abs=1e-4)


def test_plan_without_a_law_says_it_uses_the_paper_constants(capsys):
    assert main(["plan", PAPER_BASELINE, "--token-widths", "1536", "--top", "2"]) == 0
    output = capsys.readouterr().out
    assert "No fitted law (--law)" in output and "The paper's choice (§6.3): R = 4 and P = 0.6." in output
    assert "R = 4; target P 0.6" in output and "pred. loss" not in output
    assert main(["plan", PAPER_BASELINE, "--ratio", "2", "--token-widths", "1536", "--top", "2"]) == 0
    assert "The paper's choice (§6.3): P = 0.6." in capsys.readouterr().out


def test_fit_scaling_saves_a_law_the_planner_reads(tmp_path, capsys):
    from tests.test_scaling import MAIN_TRUTH, _main_runs, _write_csv

    runs = tmp_path / "runs.csv"
    _write_csv(runs, _main_runs(MAIN_TRUTH, 0.0))
    law = tmp_path / "fit.json"
    assert main(["fit-scaling", str(runs), "--save", str(law), "--restarts", "64"]) == 0
    saved = json.loads(law.read_text())
    assert saved["law"] == "main" and saved["source"] == str(runs)
    assert not list(tmp_path.glob(".*tmp*"))
    capsys.readouterr()
    arguments = ["--law", str(law), "--train-tokens", "2e11", "--token-widths", "1536", "--top", "2"]
    assert main(["plan", PAPER_BASELINE, *arguments]) == 0
    assert f"Ranked by the fitted law {law}" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("content", "extra", "message"),
    [
        (None, ["--train-tokens", "1e12"], "does not exist"),
        ("{not json", ["--train-tokens", "1e12"], "is not JSON"),
        ('{"law": "decay", "params": {}}', ["--train-tokens", "1e12"], "law='decay'"),
        ('{"law": "main", "params": {"E0": 1.0}}', ["--train-tokens", "1e12"], "parameter 'A_token'"),
        ('{"law": "main", "params": {}}', [], "--law needs --train-tokens"),
    ],
)
def test_plan_law_errors_name_the_file_and_field(tmp_path, capsys, content, extra, message):
    law = tmp_path / "law.json"
    if content is not None:
        law.write_text(content)
    assert main(["plan", PAPER_BASELINE, "--law", str(law), *extra]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and message in captured.err and len(captured.err.strip().splitlines()) == 1
    assert main(["plan", PAPER_BASELINE, "--train-tokens", "1e12"]) == 2
    assert "only used with --law" in capsys.readouterr().err
