"""The reproductions' three-way verdicts: a claim "a < b" is reproduced or opposite only when
its per-seed paired differences have |mean| ≥ 2 sample std, else unresolved; a chain of claims is
reproduced when every link is, opposite when some link is."""

from __future__ import annotations

import pytest

from tests.benchmark_scripts import load_benchmark

runner = load_benchmark("eval_bits_per_byte")


@pytest.mark.parametrize(
    ("differences", "expected"),
    [
        ([-0.5, -0.49, -0.51], "reproduced"),
        ([0.2, 0.25, 0.3], "opposite"),
        # mean -0.1, std 0.1: |mean| < 2 std.
        ([-0.2, -0.1, 0.0], "unresolved"),
        # mean -0.2, std 0.1: |mean| = 2 std exactly is resolved.
        ([-0.3, -0.2, -0.1], "reproduced"),
        ([0.0, 0.0, 0.0], "unresolved"),
        # One seed has no spread to compare with.
        ([-1.0], "unresolved"),
    ],
)
def test_paired_verdict(differences, expected):
    assert runner.paired_verdict(differences) == expected


def test_chain_verdict_and_the_printed_answer():
    assert runner.chain_verdict(["reproduced", "reproduced"]) == "reproduced"
    assert runner.chain_verdict(["reproduced", "unresolved"]) == "unresolved"
    assert runner.chain_verdict(["unresolved", "opposite", "reproduced"]) == "opposite"
    assert [runner.answer(value) for value in (None, True, False, "unresolved")] == [
        "not run", "yes", "no", "unresolved"
    ]  # fmt: skip


def dlcm_run(config: str, seed: int, loss: float, ratio: float, spread: float = 1.0) -> dict:
    curve = {"0.1": 5.0, "1": ratio}
    lengths = {"prose": 4.0 * spread, "code": 4.0, "zh": 4.0}  # longest / shortest = spread
    return dict(config=config, seed=seed, heldout=dict(loss=loss, inference_ratio=ratio,
                concept_length=lengths), curve=dict(inference_ratio=curve))  # fmt: skip


def test_dlcm_pairs_its_configurations_by_seed():
    """Global is 0.1 below normal in every seed, whatever order the runs come in (paired by list position
    the differences would be -2.1, 0.9, 0.9: unresolved); it misses the target of 4 by 0.3 more."""
    script = load_benchmark("reproduce_dlcm")
    runs = [dlcm_run("learned-normal", seed, 4.0 + seed, 4.0, 1.1 + 0.2 * seed) for seed in (2, 0, 1)]
    runs += [
        dlcm_run("learned-global", seed, 3.9 + seed, 4.3 + 0.01 * seed, 1.5 + 0.2 * seed)
        for seed in (0, 1, 2)
    ]
    runs += [dlcm_run("rule-global", seed, 4.0, 4.0) for seed in (0, 1, 2)]
    verdict = script.directions(runs)
    assert verdict["global held-out loss < normal"] == "reproduced"
    # §8.3: normal's spread is 0.4 below global's in every seed (by list position it would not be).
    assert verdict["normal's content spread < global's (longest / shortest concept length)"] == "reproduced"
    assert verdict["global nearer the target than normal (held-out inference ratio)"] == "opposite"
    assert verdict["rule holds the target (end within ±10% of R)"] is True
    assert verdict["learned creeps below target (end < 90% of R and < its 10% value)"] is False
