"""benchmarks/lslm_counterfactual.py: the per-column costs add up to the ELBO's decoder loss, a flip of
nothing changes nothing, and a short run reports every figure."""

from __future__ import annotations

import math
import random

import pytest
import torch

from tests.benchmark_scripts import load_benchmark


def traced_model(probe):
    """A small LSLM in training mode whose `segment` records what the probe needs, and one batch."""
    sizes = ["--set", "hidden_size=32", "--set", "intermediate_size=64", "--set", "kl_weight=0"]
    args = probe.parse_args(["--steps", "1", *sizes])
    args.context, args.batch_size = 48, 3
    torch.manual_seed(0)
    model = probe.synthetic.lslm_model(args, prior_mean=0.25).train()
    seen = {}
    original = model.model.segment

    def segment(view, token_states):
        seen.update(view=view, states=token_states, segmentation=original(view, token_states))
        return seen["segmentation"]

    model.model.segment = segment
    language = probe.SyntheticWords(seed=0)
    texts = probe.synthetic.sample_rows(language, args.batch_size, args.context, random.Random(0))
    return model, seen, probe.synthetic.rows_of(texts, args.context)


def test_column_costs_add_up_to_the_decoder_loss_and_an_empty_flip_changes_nothing():
    probe = load_benchmark("lslm_counterfactual")
    model, seen, batch = traced_model(probe)
    output = model(input_ids=batch, labels=batch)
    view, states, segmentation = seen["view"], seen["states"].detach(), seen["segmentation"]
    with torch.no_grad():
        costs = probe.column_costs(model, view, states, segmentation, bytes_only=False)
        same = probe.column_costs(
            model, view, states, probe.flipped(segmentation, torch.zeros_like(view.mask), view), False
        )
    # loss = (Σ decoder CE + β·prior) / predicted bytes, β = 0 here: every target is charged exactly once.
    predicted = batch[:, 1:].numel()
    assert costs.sum().item() == pytest.approx(output.loss.item() * predicted, rel=1e-5)
    torch.testing.assert_close(same, costs)


def test_a_flip_moves_only_the_costs_from_its_byte_on():
    probe = load_benchmark("lslm_counterfactual")
    model, seen, batch = traced_model(probe)
    model(input_ids=batch, labels=batch)
    view, states, segmentation = seen["view"], seen["states"].detach(), seen["segmentation"]
    flips = torch.zeros_like(view.mask)
    flips[0, 20] = True
    with torch.no_grad():
        before = probe.column_costs(model, view, states, segmentation, bytes_only=False)
        after = probe.column_costs(model, view, states, probe.flipped(segmentation, flips, view), False)
    torch.testing.assert_close(after[1:], before[1:])  # other rows untouched
    torch.testing.assert_close(after[0, :20], before[0, :20])  # earlier bytes untouched (causal)
    assert not torch.allclose(after[0, 20:], before[0, 20:])


@pytest.mark.parametrize(
    ("feedback", "rest", "layout"),
    [("surrogate", "sample", "router"), ("rank", "inferred", "router"), ("surrogate", "sample", "random")],
)
def test_a_short_run_reports_the_advantages_and_the_boundaries(feedback, rest, layout):
    probe = load_benchmark("lslm_counterfactual")
    argv = ["--steps", "4", "--log-every", "2", "--feedback", feedback, "--joint", "--set", "hidden_size=32"]
    argv += ["--rest", rest, "--generator-layout", layout]
    argv += ["--set", "intermediate_size=64", "--router-gradient", "none"]
    result = probe.main(argv)
    assert [entry["step"] for entry in result["log"]] == [2, 4]
    keys = ("advantage_at_word_ends", "advantage_elsewhere", "advantage_auc", "q_at_word_ends", "q_elsewhere")
    for key in keys:
        assert math.isfinite(result["log"][-1][key])
    assert 0 <= result["log"][-1]["advantage_auc"] <= 1
    assert 0 <= result["precision"] <= 1 and result["bits_per_byte"] > 0


def test_flips_against_inference_decisions_start_from_them(monkeypatch):
    """--rest inferred: the advantages are charged against inference's deterministic decisions (the base
    layout the decoder is first run on), not against the training sample."""
    probe = load_benchmark("lslm_counterfactual")
    model, seen, batch = traced_model(probe)
    model(input_ids=batch, labels=batch)
    view, segmentation = seen["view"], seen["segmentation"]
    free = view.mask & ~segmentation.forced
    assert not torch.equal(segmentation.inferred & free, segmentation.ends & free)  # the rests differ
    bases, original = [], probe.column_costs

    def recording(model, view, states, layout, bytes_only):
        bases.append(layout.ends.clone())
        return original(model, view, states, layout, bytes_only)

    monkeypatch.setattr(probe, "column_costs", recording)
    for rest in ("sample", "inferred"):
        args = probe.parse_args(["--rest", rest, "--gap", "8"])
        probe.advantages(model, seen, args)
    sampled_base, inferred_base = bases[0], bases[2]
    assert torch.equal(sampled_base, segmentation.ends)
    assert torch.equal(inferred_base & free, segmentation.inferred & free)
    assert torch.equal(inferred_base & ~free, segmentation.ends & ~free)  # forced ends stay


@pytest.mark.parametrize("layout", ["random", "gold"])
def test_a_generator_layout_other_than_the_router_does_not_follow_it(monkeypatch, layout):
    """--generator-layout random / gold: training runs on ends drawn at the prior mean / on the true word
    ends whatever the router says (here a router sure of closing every byte)."""
    probe = load_benchmark("lslm_counterfactual")
    args = probe.parse_args(["--steps", "2", "--generator-layout", layout, "--joint", "--log-every", "1"])
    args.context, args.batch_size, args.width = 48, 4, 32
    torch.manual_seed(0)
    model = probe.synthetic.lslm_model(args, prior_mean=0.25)
    with torch.no_grad():
        model.model.router.fc_out.bias.fill_(10.0)  # q ≈ 1 at every byte
        model.model.router.fc_out.weight.zero_()
    layouts = []
    original_loss = probe.feedback_loss

    def recording(model, seen, gold, args, predicted):
        segmentation = seen["segmentation"]
        free = seen["view"].mask & ~segmentation.forced
        layouts.append((segmentation.ends & free, gold & free, free))
        return original_loss(model, seen, gold, args, predicted)

    monkeypatch.setattr(probe, "feedback_loss", recording)
    probe.train(model, args, probe.SyntheticWords(seed=0), random.Random(0), None)
    assert len(layouts) == 2
    for ends, gold, free in layouts:
        if layout == "gold":
            assert torch.equal(ends, gold)
        else:
            assert 0.1 < (ends.sum() / free.sum()).item() < 0.4 and not torch.equal(ends, gold)
