"""The dechunk EMA scan (hf_concept.modeling.concept_scan) against the plain loop over concepts."""

import pytest
import torch

from hf_concept.modeling.concept_scan import ema_scan, ema_step, linear_recurrence
from hf_concept.reference.scan import ema_scan_loop


def scan_inputs(batch_size, num_concepts, width=6, seed=0, dtype=torch.float64):
    """Concepts, probabilities with exact 0s and 1s (resets and pure carries), and a ragged mask."""
    generator = torch.Generator().manual_seed(seed)
    concept_states = torch.randn(batch_size, num_concepts, width, generator=generator, dtype=dtype)
    probs = torch.rand(batch_size, num_concepts, generator=generator, dtype=dtype)
    probs[:, 0] = 1.0
    probs[:, 5::7] = 1.0
    probs[:, 3::11] = 0.0
    counts = torch.randint(0, num_concepts + 1, (batch_size,), generator=generator)
    counts[0] = num_concepts
    concept_mask = torch.arange(num_concepts).unsqueeze(0) < counts.unsqueeze(1)
    # Masked slots hold NaN: the scan must never read them.
    concept_states = concept_states.masked_fill(~concept_mask.unsqueeze(-1), float("nan"))
    probs = probs.masked_fill(~concept_mask, float("nan"))
    return concept_states, probs, concept_mask


@pytest.mark.parametrize(
    ("num_concepts", "block_size"), [(1, 16), (7, 16), (16, 16), (17, 4), (100, 3), (300, 16), (70, 2)]
)
def test_scan_matches_loop_outputs_and_gradients(num_concepts, block_size):
    concept_states, probs, concept_mask = scan_inputs(3, num_concepts)
    inputs = [
        (concept_states.clone().requires_grad_(True), probs.clone().requires_grad_(True)) for _ in range(2)
    ]
    fast = ema_scan(*inputs[0], concept_mask, block_size=block_size)
    loop = ema_scan_loop(*inputs[1], concept_mask)
    torch.testing.assert_close(fast, loop, rtol=1e-10, atol=1e-10)
    assert (fast[~concept_mask] == 0).all()
    upstream = torch.randn_like(fast)
    (fast * upstream).sum().backward()
    (loop * upstream).sum().backward()
    for fast_input, loop_input in zip(inputs[0], inputs[1], strict=True):
        torch.testing.assert_close(fast_input.grad, loop_input.grad, rtol=1e-10, atol=1e-10)
        assert (fast_input.grad[~concept_mask] == 0).all()


def test_scan_gradcheck_with_exact_resets():
    generator = torch.Generator().manual_seed(1)
    concept_states = torch.randn(2, 23, 3, generator=generator, dtype=torch.float64, requires_grad=True)
    probs = torch.rand(2, 23, generator=generator, dtype=torch.float64)
    probs[:, ::6] = 1.0
    probs.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda c, p: ema_scan(c, p, block_size=4), (concept_states, probs))


def test_scan_in_float32_over_many_concepts():
    concept_states, probs, concept_mask = scan_inputs(2, 1500, width=32, seed=2, dtype=torch.float32)
    torch.testing.assert_close(
        ema_scan(concept_states, probs, concept_mask), ema_scan_loop(concept_states, probs, concept_mask)
    )


def test_generic_recurrence_matches_loop():
    generator = torch.Generator().manual_seed(4)
    decay = torch.rand(2, 45, generator=generator, dtype=torch.float64) * 1.5
    weight = torch.randn(2, 45, generator=generator, dtype=torch.float64)
    states = torch.randn(2, 45, 3, generator=generator, dtype=torch.float64)
    expected, running = [], torch.zeros(2, 3, dtype=torch.float64)
    for step in range(45):
        running = decay[:, step, None] * running + weight[:, step, None] * states[:, step]
        expected.append(running)
    torch.testing.assert_close(linear_recurrence(decay, weight, states, 4), torch.stack(expected, 1))


def test_packed_documents_reset_and_padded_rows_equal_rows_alone():
    concept_states, probs, _ = scan_inputs(1, 30, seed=5)
    probs[:, 12] = 1.0
    packed = ema_scan(concept_states, probs)
    torch.testing.assert_close(packed[:, 12:], ema_scan(concept_states[:, 12:], probs[:, 12:]))
    torch.testing.assert_close(packed[:, :12], ema_scan(concept_states[:, :12], probs[:, :12]))
    # A shorter row in a batch (left-aligned concepts, masked tail) equals that row run alone.
    batch_states = torch.cat([concept_states, concept_states.flip(1)])
    batch_probs = torch.cat([probs, probs])
    batch_mask = torch.ones(2, 30, dtype=torch.bool)
    batch_mask[1, 18:] = False
    batched = ema_scan(batch_states, batch_probs, batch_mask)
    torch.testing.assert_close(batched[1:, :18], ema_scan(batch_states[1:, :18], batch_probs[1:, :18]))


def test_scan_is_causal_over_concepts():
    concept_states, probs, concept_mask = scan_inputs(2, 40, seed=6)
    reference = ema_scan(concept_states, probs, concept_mask)
    for cut in (0, 15, 16, 33):
        changed_states = concept_states.clone()
        changed_probs = probs.clone()
        changed_states[:, cut + 1 :] = torch.randn_like(changed_states[:, cut + 1 :])
        changed_probs[:, cut + 1 :] = torch.rand_like(changed_probs[:, cut + 1 :])
        changed = ema_scan(changed_states, changed_probs, concept_mask)
        torch.testing.assert_close(changed[:, : cut + 1], reference[:, : cut + 1], rtol=0, atol=1e-12)
        assert not torch.allclose(changed[:, cut + 1 :], reference[:, cut + 1 :])


def test_ema_step_chains_to_scan():
    concept_states, probs, concept_mask = scan_inputs(3, 25, seed=7)
    scanned = ema_scan(concept_states, probs, concept_mask)
    previous = torch.zeros(3, concept_states.shape[-1], dtype=concept_states.dtype)
    for slot in range(25):
        stepped = ema_step(previous, concept_states[:, slot], probs[:, slot])
        # A row whose concepts ran out keeps its state (the caller only steps rows with a new concept).
        previous = torch.where(concept_mask[:, slot, None], stepped, previous)
        real = concept_mask[:, slot]
        torch.testing.assert_close(previous[real], scanned[real, slot], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_computed_in_float32(dtype):
    concept_states, probs, concept_mask = scan_inputs(2, 200, width=16, seed=8, dtype=torch.float32)
    low_states, low_probs = concept_states.to(dtype), probs.to(dtype)
    output = ema_scan(low_states, low_probs, concept_mask)
    assert output.dtype == dtype
    assert torch.isfinite(output).all()
    # The fp32 scan of the same (rounded) inputs, rounded once, is at most one unit in the last place
    # away; a recurrence run in low precision drifts by several.
    expected = ema_scan_loop(low_states.float(), low_probs.float(), concept_mask).to(dtype)
    torch.testing.assert_close(output, expected, rtol=float(torch.finfo(dtype).eps), atol=1e-6)
    stepped = ema_step(low_states[:, 0], low_states[:, 1], low_probs[:, 1])
    assert stepped.dtype == dtype


def test_bad_inputs_raise_value_errors():
    concept_states, probs, concept_mask = scan_inputs(2, 5)
    with pytest.raises(ValueError, match="probs"):
        ema_scan(concept_states, probs[:, :4])
    with pytest.raises(ValueError, match="concept_mask"):
        ema_scan(concept_states, probs, concept_mask.long())
    with pytest.raises(ValueError, match="concept_states"):
        ema_scan(concept_states[0], probs)
    with pytest.raises(ValueError, match="block_size"):
        ema_scan(concept_states, probs, block_size=1)
    with pytest.raises(ValueError, match="probs"):
        ema_step(concept_states[:, 0], concept_states[:, 1], probs)
    assert ema_scan(concept_states[:, :0], probs[:, :0]).shape == (2, 0, 6)
