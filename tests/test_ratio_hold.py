"""Holding a ConceptMoE's tokens per concept by its threshold (hf_concept.training.ratio_hold)."""

from __future__ import annotations

import pytest
import torch

from hf_concept.modeling.configuration_conceptmoe import ConceptMoEConfig
from hf_concept.modeling.modeling_conceptmoe import ConceptMoEForCausalLM
from hf_concept.training.ratio_hold import RatioHold, threshold_for_ratio
from tests.test_conceptmoe_model import BACKBONE as CONCEPTMOE_BACKBONE

BACKBONE = dict(CONCEPTMOE_BACKBONE, encoder_layers=2, decoder_layers=2, compression_ratio=2.0)


def layout() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(3, 40) probabilities with a left-padded row and a packed row (two starts)."""
    generator = torch.Generator().manual_seed(0)
    probs = torch.rand(3, 40, generator=generator)
    mask = torch.ones(3, 40, dtype=torch.bool)
    mask[0, :7] = False
    starts = torch.zeros(3, 40, dtype=torch.bool)
    starts[0, 7] = starts[1, 0] = starts[2, 0] = starts[2, 25] = True
    return probs, starts, mask


@pytest.mark.parametrize("ratio", [1.0, 1.5, 2.0, 3.7, 8.0])
def test_threshold_opens_one_concept_per_ratio_tokens(ratio):
    probs, starts, mask = layout()
    threshold = threshold_for_ratio(probs, starts, mask, ratio)
    opened = ((probs >= threshold) & mask & ~starts).sum() + starts.sum()
    assert int(opened) == round(int(mask.sum()) / ratio)


def test_threshold_limits_and_bad_ratio():
    probs, starts, mask = layout()
    # More starts than concepts wanted: no free token opens one.
    assert threshold_for_ratio(probs, starts, mask, 100.0) == 1.0
    assert threshold_for_ratio(probs, starts, mask, 1.0) == 0.0
    with pytest.raises(ValueError, match=r"ratio=0\.5"):
        threshold_for_ratio(probs, starts, mask, 0.5)


def test_hold_sets_the_threshold_that_inference_realises_after_the_step():
    torch.manual_seed(0)
    model = ConceptMoEForCausalLM(ConceptMoEConfig(**BACKBONE))
    hold = RatioHold(model, ratio=3.0)
    assert model.config.boundary_noise == "none"
    ids = torch.randint(1, 61, (4, 48))
    optimizer = torch.optim.SGD(model.parameters(), lr=5.0)
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    # A router the loss cannot reach would be a bug: the held threshold leaves the LM gradient in place.
    router_grads = [p.grad for n, p in model.named_parameters() if "chunker" in n]
    assert router_grads and all(g is not None and g.abs().sum() > 0 for g in router_grads)
    with torch.no_grad():
        before = model.model(input_ids=ids).boundary_probs.clone()
    optimizer.step()
    threshold = hold.update()
    assert threshold == model.config.boundary_threshold and 0.0 < threshold < 1.0
    assert hold.update() is None  # nothing kept since
    model.eval()
    output = model.model(input_ids=ids)
    assert not torch.allclose(output.boundary_probs, before)  # the step moved the router ...
    # ... and the threshold was measured after it: inference realises the ratio on the step's batch.
    assert int(output.boundaries.sum()) == round(ids.numel() / 3.0)
    model(input_ids=ids)  # eval forwards are not kept
    assert hold.calls == []
    hold.remove()
    model.train()
    model(input_ids=ids)
    assert hold.calls == []


def test_hold_needs_a_conceptmoe_and_a_ratio():
    with pytest.raises(ValueError, match="no ConceptMoE stack"):
        RatioHold(torch.nn.Linear(2, 2), ratio=2.0)
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"ratio=0\.9"):
        RatioHold(ConceptMoEForCausalLM(ConceptMoEConfig(**BACKBONE)), ratio=0.9)


def test_train_command_holds_the_configured_ratio(tmp_path, capsys):
    """`hf-concept train --hold-ratio`: the saved model infers at its compression_ratio on its own data."""
    from hf_concept.modeling.modeling_conceptmoe import ConceptMoEForCausalLM as Saved
    from tests.conformance.families import _conceptmoe_config, _dlcm_config
    from tests.test_train_command import _train, make_workspace

    workspace = make_workspace(tmp_path / "workspace")
    config = tmp_path / "conceptmoe.json"
    config.write_text(_conceptmoe_config(compression_ratio=3.0).to_json_string())
    common = ["--data", workspace / "corpus.txt", "--tokenizer", workspace / "tokenizer", "--max-steps", "4"]
    status, _, stderr, _ = _train(capsys, config, *common, "--output-dir", tmp_path / "out", "--hold-ratio")
    assert status == 0, stderr
    model = Saved.from_pretrained(tmp_path / "out").eval()
    assert model.config.boundary_threshold != 0.5 and model.config.boundary_noise == "none"
    ids = torch.randint(3, 97, (4, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        boundaries = model.model(input_ids=ids).boundaries
    assert 2.0 < ids.numel() / int(boundaries.sum()) < 4.5

    config.write_text(_dlcm_config().to_json_string())
    status, _, stderr, _ = _train(capsys, config, *common, "--output-dir", tmp_path / "dlcm", "--hold-ratio")
    assert status == 2 and "hold_ratio needs a ConceptMoE with dynamic chunking" in stderr
    assert "model_type='dlcm'" in stderr and not (tmp_path / "dlcm").exists()


def test_calibration_over_many_batches_holds_the_ratio_on_all_of_them():
    from hf_concept.training.ratio_hold import calibrate_threshold

    torch.manual_seed(0)
    model = ConceptMoEForCausalLM(ConceptMoEConfig(**BACKBONE)).eval()
    batches = [torch.randint(1, 61, (2, 40)) for _ in range(3)]
    threshold = calibrate_threshold(model, batches, ratio=2.5)
    assert model.config.boundary_threshold == threshold
    opened = sum(int(model.model(input_ids=batch).boundaries.sum()) for batch in batches)
    assert opened == round(3 * 2 * 40 / 2.5)
    with pytest.raises(ValueError, match="at least one batch"):
        calibrate_threshold(model, [], ratio=2.0)
