"""benchmarks/lslm_synthetic.py: the router's own learning rate (`--router-lr-factor`) reaches exactly its
parameters, and a tiny run reports the boundary figures and bits per byte."""

from __future__ import annotations

import torch

from tests.benchmark_scripts import load_benchmark

TINY = ["--set", "hidden_size=32", "--set", "intermediate_size=64", "--context", "48", "--batch-size", "3"]


def test_the_router_learning_rate_reaches_exactly_the_router():
    script = load_benchmark("lslm_synthetic")
    args = script.parse_args(["--router-lr-factor", "10", "--lr", "0.002", *TINY])
    torch.manual_seed(0)
    model = script.lslm_model(args, prior_mean=0.25)
    groups = script.parameter_groups(model, args)
    names = {id(p): name for name, p in model.named_parameters()}
    assert [group["lr"] for group in groups] == [0.002, 0.02]
    assert all(".router." in f".{names[id(p)]}" for p in groups[1]["params"])
    assert not any(".router." in f".{names[id(p)]}" for p in groups[0]["params"])
    assert len(groups[0]["params"]) + len(groups[1]["params"]) == len(list(model.parameters()))
    # A byte baseline has no router: one group at --lr.
    assert [group["lr"] for group in script.parameter_groups(script.baseline_model(args), args)] == [0.002]


def test_a_tiny_run_reports_the_boundaries_and_the_code_length():
    script = load_benchmark("lslm_synthetic")
    (result,) = script.main(
        ["--steps", "2", "--no-baseline", "--heldout-rows", "4", "--router-lr-factor", "3", *TINY]
    )
    figures = result["lslm"]
    assert 0 <= figures["precision"] <= 1 and 0 <= figures["recall"] <= 1 and figures["bits_per_byte"] > 0
    assert "baseline" not in result


def test_gold_ends_segment_the_texts_at_their_word_starts_in_training_and_eval():
    """`--ends gold`: the training forward and the evaluation both open a segment exactly at each word
    start (the row's first byte is forced open), so the oracle row measures what words are worth."""
    script = load_benchmark("lslm_synthetic")
    args = script.parse_args(["--ends", "gold", *TINY])
    language = script.SyntheticWords(seed=0)
    texts = script.sample_rows(language, 3, args.context, script.random.Random(0))
    torch.manual_seed(0)
    model = script.lslm_model(args, prior_mean=0.25)
    gold = script.GoldEnds(model)
    gold.use(texts, args.context)
    ids = script.rows_of(texts, args.context)
    expected = torch.zeros(ids.shape, dtype=torch.bool)
    for row, text in enumerate(texts):
        expected[row, [start + 1 for start in text.word_starts if start < args.context]] = True
    model.train()
    opens = model(input_ids=ids, labels=ids).boundaries.bool()
    assert torch.equal(opens[:, 1:], expected[:, 1:])
    figures = script.evaluate(model, texts, args.context)
    assert figures["precision"] == 1 and figures["recall"] == 1
