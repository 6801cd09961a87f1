"""Keeps benchmarks/bench_lslm.py from rotting: `--quick` runs decode and training end to end, and the
pieces its figures rest on (the router setting, the forced-text decoding, the timing wrappers, the
profile) do what they say."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.benchmark_scripts import load_benchmark

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_lslm.py"


@pytest.mark.parametrize("baseline", ["byte", "gpt2"])
def test_quick_run_prints_every_part_with_positive_ratios(tmp_path, baseline):
    figures_path = tmp_path / "figures.json"
    command = [sys.executable, str(SCRIPT), "--quick", "--threads", "1", "--parts", "decode,train"]
    result = subprocess.run(
        [*command, "--baseline", baseline, "--json", str(figures_path)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    printed = result.stdout
    for title in ("[decode: greedy generate", "[training: forward + backward"):
        assert printed.count(title) == 1, title
    # The outputs name the baseline that ran, never another.
    other = {"byte": "gpt2", "gpt2": "byte"}[baseline]
    assert f"baseline {baseline} (" in printed
    assert f"x {baseline}" in printed and f"x {other}" not in printed
    assert printed.count("router of lslm-") == 4
    figures = json.loads(figures_path.read_text())
    decode = figures["decode"]
    assert {(row["mode"], row["model"]) for row in decode} == {
        (mode, model) for mode in ("text", "free") for model in ("lslm-mean", "lslm-hops:3")
    }
    assert all(
        row["ratio"] > 0 and row["ms_per_byte"] > 0 and 0 <= row["boundary_rate"] <= 1 for row in decode
    )
    assert all(row["baseline"] == baseline and row["baseline_ms_per_byte"] > 0 for row in decode)
    assert printed.count("<= 1.0x: ") == 4
    train = figures["train"]
    assert [row["model"] for row in train] == ["lslm-mean", "lslm-hops:3"]
    assert all(row["ratio"] > 0 and row["bytes_per_s"] > 0 for row in train)
    assert all(row["baseline"] == baseline and row["baseline_bytes_per_s"] > 0 for row in train)
    assert set(figures["routers"]) == {"decode", "train"}
    for part, settings in figures["routers"].items():
        assert set(settings) == {"lslm-mean", "lslm-hops:3"}
        for name, setting in settings.items():
            assert setting["rate"] == pytest.approx(0.2, abs=0.02), (part, name)
            assert 0 <= setting["other_text_rate"] <= 1, (part, name)


def test_baseline_choice_builds_the_named_model():
    bench = load_benchmark("bench_lslm")
    byte = bench.build_models(bench.parse_args(["--quick"]))[bench.BASELINE]
    gpt2 = bench.build_models(bench.parse_args(["--quick", "--baseline", "gpt2"]))[bench.BASELINE]
    # byte: the project's decoder at the segment encoder's width and the LSLM's total depth (1 + 1 + 1).
    assert type(byte).__name__ == "PlainDecoderForCausalLM"
    assert (byte.config.num_hidden_layers, byte.config.hidden_size) == (3, bench.QUICK["width"])
    assert byte.config._attn_implementation == gpt2.config._attn_implementation == "sdpa"
    assert type(gpt2).__name__ == "GPT2LMHeadModel" and gpt2.config.n_layer == 3
    deeper = bench.parse_args(["--quick", "--baseline-layers", "5"])
    assert bench.build_models(deeper)[bench.BASELINE].config.num_hidden_layers == 5


def test_router_setting_forced_decoding_and_timers():
    bench = load_benchmark("bench_lslm")
    args = bench.parse_args(["--quick"])
    models = bench.build_models(args)
    model = models["lslm-mean"]
    rows = bench.decode_row(argparse.Namespace(**{**vars(args), "new_bytes": 400}))
    # Untrained, q sits near 1/2; set, a `rate` share of bytes reaches the threshold, q mostly near 0 or 1.
    # Setting it again starts from the untrained router (a set one saturates q).
    untrained = bench.untrained_routers(models)
    scales = []
    for rate in (0.5, 0.25):
        setting = bench.calibrate_router(model, rows, rate, untrained["lslm-mean"])
        assert setting["rate"] == pytest.approx(rate, abs=0.01) and setting["threshold"] == 0.5
        scales.append(setting["scale"])
    assert scales[1] == pytest.approx(scales[0]) and scales[0] > 10
    probs = bench.lslm_boundary_probabilities(model, rows)[rows >= bench.BYTE_OFFSET]
    assert ((probs < 0.05) | (probs > 0.95)).float().mean() > 0.6
    with torch.no_grad():
        opened = model(input_ids=rows).boundaries[:, 2:].float().mean().item()
    assert opened == pytest.approx(0.25, abs=0.01)
    # Forced decoding writes exactly the continuation, whichever model.
    prompt, continuation = bench.decode_inputs(args)
    for candidate in (model, models[bench.BASELINE]):
        _, sequences = bench.generate_call(candidate, prompt, args.new_bytes, continuation)()
        assert torch.equal(sequences[0, prompt.shape[1] :], continuation)
    # Timing wrappers count while active and leave nothing behind.
    push = vars(bench.SegmentCache)["push_open_states"]
    timers = bench.lslm_timers(model)
    try:
        bench.cached_loop(model, prompt, continuation, timers)
    finally:
        timers.restore()
    assert timers.calls["step (all)"] == len(continuation)
    assert timers.calls["token encoder step"] == len(continuation)
    assert not {"step", "token_step", "close_segments", "decoder_pass"} & set(vars(model.model))
    assert "forward" not in vars(model.lm_head) and "forward" not in vars(model.model.router)
    assert vars(bench.SegmentCache)["push_open_states"] is push
    # The profile part: every LSLM part timed, the step's parts inside its total.
    profile = bench.bench_profile(models, args)
    bench.print_profile(profile)
    assert profile[bench.BASELINE]["name"] == "byte"
    for name in ("lslm-mean", "lslm-hops:3"):
        entry = profile[name]
        assert list(entry["parts"])[:5] == list(bench.STEP_PARTS)
        assert all(value > 0 for value in entry["parts"].values()), entry["parts"]
        assert sum(entry["parts"].values()) == pytest.approx(entry["step_ms"], rel=1e-6)
        assert entry["closes_per_step"] > 0 and entry["ms_per_close"] > 0
        assert entry["aten_ops"] > profile[bench.BASELINE]["aten_ops"] > 0
        assert entry["baseline_step_ms"] > 0
