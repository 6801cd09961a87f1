"""LSLM as the paper builds it: the decoder knows the segment it continues, the Beta prior scores
the boundary rate, the estimator is Gumbel-sigmoid + straight-through into the pooling matrix, and bits
per byte renormalised over the byte ids are a decodable code."""

from __future__ import annotations

import json

import pytest
import torch

from hf_concept.evaluation import bits_per_byte
from hf_concept.modeling.configuration_lslm import LSLMConfig
from hf_concept.modeling.lslm_estimators import (
    beta_binomial_prior_nll,
    beta_parameters,
    straight_through_ends,
    straight_through_pool_weights,
    straight_through_target_losses,
)
from hf_concept.modeling.modeling_lslm import LSLMForCausalLM
from hf_concept.modeling.pooling import chunk_index, pool_concepts
from hf_concept.modeling.routing import bernoulli_kl_from_logits
from hf_concept.modeling.tokenization_lslm import BYTE_OFFSET, ByteTokenizer
from hf_concept.reference.routing import (
    beta_binomial_reference,
    pooling_matrix_reference,
    straight_through_ends_reference,
    straight_through_target_losses_reference,
)
from tests.test_lslm_learning import TINY, tiny_lslm

TEXT = "the cat sat on the mat, and the dog ran off."


def router_pass(model: LSLMForCausalLM, seed: int = 5):
    """One training pass on `TEXT` with its loss backpropagated; returns the pass's `Segmentation`, whose
    router logits keep their gradient."""
    encoded = ByteTokenizer()([TEXT], return_tensors="pt")
    captured = {}
    segment = model.model.segment

    def keep(view, token_states):
        segmentation = segment(view, token_states)
        segmentation.logits.retain_grad()
        captured["segmentation"] = segmentation
        return segmentation

    model.model.segment = keep
    torch.manual_seed(seed)
    model(**encoded, labels=encoded["input_ids"]).loss.backward()
    return captured["segmentation"]


def test_paper_settings_are_the_defaults():
    config = LSLMConfig()
    assert (config.prior_loss, config.boundary_estimator, config.decoder_latest_segment) == (
        "beta_binomial",
        "straight_through",
        True,
    )
    assert config.beta_prior() == pytest.approx((70.0, 30.0))
    assert LSLMConfig(prior_alpha=2.0, prior_beta=6.0).beta_prior() == (2.0, 6.0)
    assert beta_parameters(0.25, 8.0) == (2.0, 6.0)
    for field, value in (("boundary_estimator", "reinforce"), ("decoder_latest_segment", "yes")):
        with pytest.raises(ValueError, match=field):
            LSLMConfig(**{field: value})


def test_a_config_saved_before_issue_28_loads_with_its_former_behaviour(tmp_path):
    saved = LSLMConfig(**TINY).to_dict()
    for field in ("prior_loss", "boundary_estimator", "decoder_latest_segment", "prior_concentration"):
        saved.pop(field)
    (tmp_path / "config.json").write_text(json.dumps(saved))
    loaded = LSLMConfig.from_pretrained(tmp_path)
    assert (loaded.prior_loss, loaded.boundary_estimator, loaded.decoder_latest_segment) == (
        "kl",
        "confidence",
        False,
    )
    assert LSLMForCausalLM(loaded).model.segment_to_decoder is None
    # A config built in code (no transformers_version) gets the paper's settings.
    assert LSLMConfig.from_dict({"hidden_size": 32}).boundary_estimator == "straight_through"


# Point 3: the estimator.


def test_straight_through_ends_are_the_decisions_with_an_identity_gradient():
    torch.manual_seed(0)
    relaxed = torch.rand(3, 12, requires_grad=True)
    ends = relaxed.detach() >= 0.5
    free = torch.rand(3, 12) < 0.8
    weights = torch.randn(3, 12)
    straight = straight_through_ends(relaxed, ends, free)
    assert torch.equal(straight, ends.float())
    (gradient,) = torch.autograd.grad((straight * weights).sum(), relaxed)
    torch.testing.assert_close(gradient, weights * free, atol=0, rtol=0)
    reference = straight_through_ends_reference(relaxed, ends, free)
    (expected,) = torch.autograd.grad((reference * weights.double()).sum(), relaxed)
    torch.testing.assert_close(gradient, expected.float(), atol=1e-7, rtol=0)


def test_pooling_weights_are_the_paper_pooling_matrix_straight_through():
    """Values: exactly the hard mean pooling. Gradients: those of Figure 3's matrix B built entry by entry
    (V = m − ĉ, B = 1 − V where V = 0), normalised by its column sums, as dynamic pooling does."""
    torch.manual_seed(1)
    relaxed = torch.rand(2, 9, requires_grad=True)
    ends = relaxed.detach() >= 0.6
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, :2] = False  # left padding
    ends = ends & mask
    free = mask.clone()
    straight = straight_through_ends(relaxed, ends, free)
    opens = torch.nn.functional.pad(ends, (1, 0))[:, :-1] & mask
    opens[0, 0] = opens[1, 2] = True
    index = chunk_index(opens, mask)
    num_segments = int(index.max()) + 1
    states = torch.randn(2, 9, 5)
    weights = straight_through_pool_weights(straight, mask)
    assert torch.equal(weights, mask.float())
    means, _ = pool_concepts(states, opens, mask, "mean", weights)
    hard, _ = pool_concepts(states, opens, mask, "mean")
    torch.testing.assert_close(means, hard, atol=1e-6, rtol=0)
    probe = torch.randn_like(means)
    (gradient,) = torch.autograd.grad((means * probe).sum(), relaxed)
    matrix = pooling_matrix_reference(
        straight_through_ends_reference(relaxed, ends, free), mask, num_segments
    )
    assert torch.equal(
        matrix.detach(), torch.nn.functional.one_hot(index.clamp(min=0), num_segments) * mask[..., None]
    )
    reference = torch.einsum("btm,btd->bmd", matrix, states.double()) / matrix.sum(dim=1)[..., None]
    (expected,) = torch.autograd.grad((reference * probe.double()).sum(), relaxed)
    torch.testing.assert_close(gradient, expected.float(), atol=1e-6, rtol=1e-5)
    assert bool((gradient != 0).any())


def test_target_losses_take_the_decision_straight_through():
    """Values: the hard target's loss. Gradients: ℓ_end − ℓ_continue to the decision, the chosen loss only
    to the decoder."""
    torch.manual_seed(3)
    relaxed = torch.rand(2, 7, requires_grad=True)
    ends = relaxed.detach() >= 0.5
    free = torch.ones(2, 7, dtype=torch.bool)
    end_losses = torch.rand(2, 7, requires_grad=True)
    continue_losses = torch.rand(2, 7, requires_grad=True)
    mixed = straight_through_target_losses(
        straight_through_ends(relaxed, ends, free), end_losses, continue_losses
    )
    assert torch.equal(mixed, torch.where(ends, end_losses, continue_losses))
    weights = torch.randn(2, 7)
    gradients = torch.autograd.grad((mixed * weights).sum(), (relaxed, end_losses, continue_losses))
    reference = straight_through_target_losses_reference(
        straight_through_ends_reference(relaxed, ends, free), end_losses.double(), continue_losses.double()
    )
    expected = torch.autograd.grad(
        (reference * weights.double()).sum(), (relaxed, end_losses, continue_losses)
    )
    for got, want in zip(gradients, expected, strict=True):
        torch.testing.assert_close(got, want.float(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(gradients[0], weights * (end_losses - continue_losses).detach())
    torch.testing.assert_close(gradients[1], weights * ends)


def test_the_target_estimator_reaches_the_router_at_every_free_byte():
    """`straight_through_targets`, with no prior term: the LM loss alone reaches every free decision that
    has a next byte in its document (through that byte's slot target, and inside a segment through the
    pooling)."""
    segmentation = router_pass(
        tiny_lslm(kl_weight=0.0, boundary_estimator="straight_through_targets", segment_end_loss=True).train()
    )
    free = ~segmentation.forced[0]
    free[-1] = False  # the last byte has no next byte (here it is `<eos>`, forced anyway)
    assert free.sum() > 20
    assert bool((segmentation.logits.grad[0][free] != 0).all())


def test_the_lm_loss_reaches_the_router_through_the_pooling():
    """With no prior term, the LM loss alone moves the router: every free byte that leaves its segment
    open before another byte of the same segment gets a gradient (an end there would split the segment),
    and the forward value is the one the hard decisions give."""
    model = tiny_lslm(kl_weight=0.0).train()
    segmentation = router_pass(model)
    gradient = segmentation.logits.grad[0]
    ends, index = segmentation.ends[0], segmentation.index[0]
    free = ~segmentation.forced[0]
    splitting = free & ~ends & (torch.nn.functional.pad(index, (0, 1), value=-1)[1:] == index)
    assert splitting.sum() >= 5, "the test needs open bytes inside segments"
    assert bool((gradient[splitting] != 0).all())
    assert model.model.router.fc_in.weight.grad.abs().sum() > 0


# Point 2: the prior.


@pytest.mark.parametrize(
    ("count", "total", "alpha", "beta"), [(0, 10, 7.0, 3.0), (7, 10, 7.0, 3.0), (3, 40, 2.5, 7.5)]
)
def test_beta_binomial_matches_the_integrated_binomial(count, total, alpha, beta):
    value = beta_binomial_prior_nll(torch.tensor([float(count)]), torch.tensor([float(total)]), alpha, beta)
    assert value.item() == pytest.approx(-beta_binomial_reference(count, total, alpha, beta), rel=1e-5)


def test_beta_binomial_gradient_is_the_digamma_difference():
    counts = torch.tensor([1.0, 5.0, 9.0], requires_grad=True)
    totals = torch.tensor([12.0, 12.0, 12.0])
    (gradient,) = torch.autograd.grad(beta_binomial_prior_nll(counts, totals, 3.0, 5.0).sum(), counts)
    k = counts.detach()
    expected = (
        torch.digamma(k + 1)
        - torch.digamma(totals - k + 1)
        - torch.digamma(k + 3.0)
        + torch.digamma(totals - k + 5.0)
    )
    torch.testing.assert_close(gradient, expected, atol=1e-5, rtol=1e-5)


def test_the_beta_prior_scores_the_rate_and_does_not_pin_each_byte():
    """The Bernoulli KL is minimised only by q_t = p on every byte. The Beta-Binomial term depends on the
    count alone: a row that is sure at every byte (q in {0, 1}) with a likely count costs what a row of
    q_t = p costs, and minimising the term from a spread start keeps the bytes spread."""
    alpha, beta = beta_parameters(0.3, 10.0)
    n = 40
    sure = torch.tensor([1.0] * 12 + [0.0] * 28)
    even = torch.full((n,), 0.3)
    totals = torch.tensor([float(n)])
    assert beta_binomial_prior_nll(sure.sum()[None], totals, alpha, beta).item() == pytest.approx(
        beta_binomial_prior_nll(even.sum()[None], totals, alpha, beta).item()
    )
    logits = (torch.linspace(-3, 3, n)).requires_grad_(True)
    start = torch.sigmoid(logits.detach()).std().item()
    kl_logits = logits.detach().clone().requires_grad_(True)
    beta_optimizer = torch.optim.SGD([logits], lr=0.5)
    kl_optimizer = torch.optim.SGD([kl_logits], lr=0.5)
    for _ in range(300):
        beta_optimizer.zero_grad()
        beta_binomial_prior_nll(torch.sigmoid(logits).sum()[None], totals, alpha, beta).sum().backward()
        beta_optimizer.step()
        kl_optimizer.zero_grad()
        bernoulli_kl_from_logits(kl_logits, 0.3).sum().backward()
        kl_optimizer.step()
    q, kl_q = torch.sigmoid(logits.detach()), torch.sigmoid(kl_logits.detach())
    assert kl_q.std().item() < 0.01 and kl_q.mean().item() == pytest.approx(0.3, abs=0.01)
    # Only the count moved (to a likely one); each byte kept its own value.
    assert q.std().item() > 0.5 * start
    assert 0.15 < q.mean().item() < 0.45


def test_the_model_scores_the_beta_prior_on_the_sampled_count():
    model = tiny_lslm(kl_weight=1.0, prior_mean=0.25, prior_concentration=8.0).train()
    encoded = ByteTokenizer()([TEXT], return_tensors="pt")
    captured = {}
    segment = model.model.segment

    def keep(view, token_states):
        captured["segmentation"] = segmentation = segment(view, token_states)
        return segmentation

    model.model.segment = keep
    with torch.no_grad():
        output = model(**encoded, labels=encoded["input_ids"])
    segmentation = captured["segmentation"]
    free = ~segmentation.forced[0]
    count, total = int(segmentation.ends[0][free].sum()), int(free.sum())
    expected = -beta_binomial_reference(count, total, 2.0, 6.0) / total
    assert output.kl_loss.item() == pytest.approx(expected, rel=1e-4)


# Point 1: the decoder knows the segment it continues.


def test_the_decoder_tells_the_latest_segment_from_the_earlier_ones():
    """Cross-attention sees a set: swapping two earlier segments changes nothing. Swapping which segment is
    the latest changes the `<bos>` slot's state: the decoder knows which segment it continues."""
    model = tiny_lslm().eval()
    encoded = ByteTokenizer()([TEXT], return_tensors="pt")
    backbone = model.model
    with torch.no_grad():
        layout = backbone.parallel_pass(encoded["input_ids"], encoded["attention_mask"])
    slots, view = layout.slots, layout.view
    segments, valid, documents = backbone.encode_segments(
        backbone.encode_tokens(view), layout.segmentation, view
    )
    last = int(slots.reads.max()) - 1
    assert last >= 3
    pending = slots.reads == last + 1  # the slots that read every segment, the latest being `last`

    def decoded(order: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return backbone.decode(slots, segments[:, order], valid, documents)[pending]

    identity = list(range(segments.shape[1]))
    earlier_swapped = identity.copy()
    earlier_swapped[0], earlier_swapped[1] = 1, 0
    latest_swapped = identity.copy()
    latest_swapped[last - 1], latest_swapped[last] = last, last - 1
    torch.testing.assert_close(decoded(earlier_swapped), decoded(identity), atol=1e-6, rtol=0)
    assert (decoded(latest_swapped) - decoded(identity)).abs().max() > 1e-3


# Point 5: bits per byte as a code.


def test_bytes_renormalised_bits_are_a_decodable_code():
    """Every probability the "bytes" figure uses is the one a decoder computes from the bytes before it
    alone: the figure equals the sum of -log2 p(b_i | b_<i) with each term from a pass over the prefix
    only, softmaxed over the 256 byte ids. And it is shorter than the all-ids figure by the mass the
    decoder puts on markers."""
    model = tiny_lslm(seed=2).eval()
    tokenizer = ByteTokenizer()
    text = "a cat, a mat"
    ids = tokenizer([text], add_special_tokens=False)["input_ids"][0]
    prefix_ids = [1]  # <BoS>
    nats = 0.0
    with torch.no_grad():
        for token in ids:
            logits = model(input_ids=torch.tensor([prefix_ids])).logits[
                0, -1, BYTE_OFFSET : BYTE_OFFSET + 256
            ]
            nats -= torch.log_softmax(logits.double(), dim=-1)[token - BYTE_OFFSET].item()
            prefix_ids.append(token)
    renormalised = bits_per_byte(model, tokenizer, text, context=64, stride=32, normalization="bytes")
    everything = bits_per_byte(model, tokenizer, text, context=64, stride=32)
    assert renormalised.nats == pytest.approx(nats, rel=1e-6)
    assert renormalised.bits_per_byte < everything.bits_per_byte
    with pytest.raises(ValueError, match="normalization='tokens'"):
        bits_per_byte(model, tokenizer, text, normalization="tokens")


def test_generation_with_the_latest_segment_equals_recomputation():
    """Cached greedy decoding reads the latest segment from the cache as the parallel pass does."""
    model = tiny_lslm(seed=4, boundary_rule="threshold", boundary_threshold=0.5).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    prompt = ByteTokenizer()(["the cat sat"], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        generated = model.generate(prompt, max_new_tokens=24, do_sample=False)
        sequence = prompt
        for _ in range(24):
            following = model(sequence, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            sequence = torch.cat([sequence, following], dim=1)
    assert torch.equal(generated, sequence)
    assert model.model.segment_to_decoder is not None
