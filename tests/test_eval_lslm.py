"""LSLM rows of the bits-per-byte evaluation: the byte path through `bits_per_byte` against a hand
computation from the per-token logits, the ELBO view (`lslm_code_length`) against an independent
computation with explicit `<nxt>` markers, and the script's `--quick --lslm` run."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hf_concept.data import LANGUAGES
from hf_concept.evaluation import bits_per_byte, lslm_boundary_probabilities, lslm_code_length
from hf_concept.modeling.tokenization_lslm import BYTE_OFFSET, SEQUENCE_START_ID, ByteTokenizer
from tests.test_lslm_model import lslm

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "eval_bits_per_byte.py"
TEXT = "Tea at 4pm? 茶を飲みましょう。好的！ ok, segments\n"
NXT = 4
NAMES = ("lslm-mean", "lslm-mean@rate")


@pytest.fixture(scope="module")
def tokenizer() -> ByteTokenizer:
    return ByteTokenizer()


@pytest.fixture(scope="module")
def model():
    # The threshold rule: the tests below switch the router off by raising the threshold.
    return lslm(seed=5, pooling="hops:2", boundary_rule="threshold")


def token_ids(text: str) -> torch.Tensor:
    return torch.tensor([SEQUENCE_START_ID, *(BYTE_OFFSET + b for b in text.encode("utf-8"))])


def next_token_nats(model, ids: torch.Tensor) -> torch.Tensor:
    """(T - 1,) float64: -log p(ids[t + 1]) under the per-token logits at t, one unpadded forward pass."""
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0, :-1]
    return -F.log_softmax(logits.double(), dim=-1).gather(-1, ids[1:, None])[:, 0]


def test_bits_per_byte_of_an_lslm_is_the_per_token_logits_code_length(model, tokenizer):
    ids = token_ids(TEXT)
    num_bytes = len(ids) - 1
    whole = bits_per_byte(model, tokenizer, TEXT, context=len(ids), stride=num_bytes)
    assert whole.num_bytes == num_bytes
    assert whole.nats == pytest.approx(next_token_nats(model, ids).sum().item(), rel=1e-6)
    with torch.no_grad():
        boundaries = model(input_ids=ids[None]).boundaries[0]
    assert 1 < int(boundaries[1:].sum()) < num_bytes, "the test needs multi-byte segments"
    # Sliding windows, batched with right padding: each window scored alone by hand (no padding).
    context, stride = 12, 5
    expected = 0.0
    for first in range(1, len(ids), stride):
        end = min(first + stride, len(ids))
        start = max(0, end - context)
        expected += next_token_nats(model, ids[start:end])[first - start - 1 :].sum().item()
    windowed = bits_per_byte(model, tokenizer, TEXT, context=context, stride=stride, batch_size=3)
    assert windowed.nats == pytest.approx(expected, rel=1e-6)


def router_closes(model, ids: torch.Tensor) -> list[bool]:
    """For each byte of `ids` (`<BoS>` then bytes): does the router end its segment there? Read from the
    public `boundaries` (a byte opens a segment iff the one before closed it), the last byte's decision
    from a row one byte longer (the router reads the prefix only)."""
    longer = torch.cat([ids, torch.tensor([BYTE_OFFSET + ord("x")])])
    with torch.no_grad():
        opens = model(input_ids=longer[None]).boundaries[0]
    return opens[2:].tolist()


def test_elbo_view_matches_explicit_nxt_markers(model, tokenizer):
    """Independently: write the router's boundaries into the text as `<nxt>` markers and raise the
    threshold so that the router closes nothing itself; the segments are then the same, and the
    per-token logits at each column predict the next input token, bytes and markers alike."""
    ids = token_ids(TEXT)
    closes = router_closes(model, ids)
    annotated = [SEQUENCE_START_ID]
    for byte, close in zip(ids[1:].tolist(), closes, strict=True):
        annotated += [byte, NXT] if close else [byte]
    annotated = torch.tensor(annotated)
    threshold = model.config.boundary_threshold
    model.config.boundary_threshold = 1 - 1e-6
    try:
        nats = next_token_nats(model, annotated)
    finally:
        model.config.boundary_threshold = threshold
    is_marker = annotated[1:] == NXT
    code = lslm_code_length(model, tokenizer, TEXT, context=len(ids), stride=len(ids) - 1)
    assert sum(closes) >= 2 and code.num_bytes == len(ids) - 1
    assert code.boundary_nats == pytest.approx(nats[is_marker].sum().item(), rel=1e-5)
    assert code.byte_nats == pytest.approx(nats[~is_marker].sum().item(), rel=1e-5)
    # Segments: the first byte opens one, and every boundary before another byte opens the next.
    assert code.num_segments == 1 + sum(closes[:-1])
    assert code.bytes_per_segment == pytest.approx(code.num_bytes / code.num_segments)
    # The router's q: thresholded, the same decisions; averaged, the reported mean.
    probs = lslm_boundary_probabilities(model, ids[None])[0, 1:]
    assert (probs >= model.config.boundary_threshold).tolist() == closes
    assert code.mean_boundary_probability == pytest.approx(probs.double().mean().item(), rel=1e-6)


def test_elbo_view_byte_part_equals_bits_per_byte_over_sliding_windows(model, tokenizer):
    windows = dict(context=10, stride=4, batch_size=4)
    code = lslm_code_length(model, tokenizer, TEXT, **windows)
    byte_path = bits_per_byte(model, tokenizer, TEXT, **windows)
    assert code.byte_nats == pytest.approx(byte_path.nats, rel=1e-9)
    assert code.boundary_nats > 0 and code.num_segments > 1
    assert code.bits_per_byte == pytest.approx(
        (code.byte_nats + code.boundary_nats) / (code.num_bytes * math.log(2))
    )
    with pytest.raises(ValueError, match="stride=10"):
        lslm_code_length(model, tokenizer, TEXT, context=10, stride=10)


def test_quick_run_with_an_lslm_prints_finite_numbers_for_every_language(tmp_path):
    report = tmp_path / "report.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--threads", "1", "--lslm", "mean", "--json", str(report)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    table, elbo_table = result.stdout.split("LSLM ELBO view")
    lines = table.splitlines()
    gpt2 = next(line.split() for line in lines if line.startswith("gpt2-byte "))
    rows = {name: next(line.split() for line in lines if line.startswith(name + " ")) for name in NAMES}
    for row in rows.values():
        # Matched parameters: the baseline within 3% of the LSLM's count, both printed.
        assert abs(int(gpt2[1]) - int(row[1])) <= 0.03 * int(row[1])
        assert all(math.isfinite(float(cell)) and 0 < float(cell) < 12 for cell in row[-3:])
    for name in NAMES:
        elbo = [line.split() for line in elbo_table.splitlines() if line.startswith(name + " ")]
        assert [cells[1] for cells in elbo] == list(LANGUAGES)
        for cells in elbo:
            byte_bits, boundary_bits, total, per_segment, mean_q = map(float, cells[2:])
            assert all(math.isfinite(value) for value in (byte_bits, boundary_bits, total, per_segment))
            assert boundary_bits >= 0 and per_segment >= 1 and 0 < mean_q < 1
            assert total == pytest.approx(byte_bits + boundary_bits, abs=2e-3)
    for lslm_result in json.loads(report.read_text())["results"][1:]:
        for language, cell in lslm_result["elbo_view"].items():
            # The ELBO view's byte part is the byte path on the same windows.
            assert cell["byte_bits"] == pytest.approx(lslm_result["bits_per_byte"][language], rel=1e-9)


def test_bad_lslm_flags_exit_with_a_message(capsys):
    spec = importlib.util.spec_from_file_location("eval_bits_per_byte", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    for flags, message in (
        (["--lslm", "first"], "--lslm first"),
        (["--lslm", "mean", "--lslm-layers", "2,4"], "'2,4' must be three positive ints"),
    ):
        with pytest.raises(SystemExit) as raised:
            script.parse_args(flags)
        assert raised.value.code == 2
        assert message in capsys.readouterr().err
    assert script.parse_args(["--no-baseline", "--lslm", "hops:3"]).lslm == ["hops:3"]


def test_lslm_flags_default_to_the_config_a_user_gets():
    """`--lslm mean` alone trains `LSLMConfig`'s defaults (joint updates, its prior); a flag overrides one."""
    from hf_concept.modeling.configuration_lslm import LSLMConfig
    from tests.benchmark_scripts import load_benchmark

    script = load_benchmark("eval_bits_per_byte")
    defaults = LSLMConfig()
    plain = script.lslm_config(script.parse_args(["--lslm", "mean"]), "mean")
    for field in ("prior_mean", "kl_weight", "update_schedule", "prior_loss"):
        assert getattr(plain, field) == getattr(defaults, field), field
    given = ["--lslm", "mean", "--lslm-update-schedule", "3", "--lslm-prior", "0.2"]
    given += ["--lslm-prior-loss", "kl"]
    config = script.lslm_config(script.parse_args(given), "mean")
    assert (config.update_schedule, config.prior_mean, config.prior_loss) == (3, 0.2, "kl")
