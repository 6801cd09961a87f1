"""DLCM concept replication (hf_concept.modeling.dlcm_replication): replicated SDPA = counted form =
reference."""

import pytest
import torch

from hf_concept.modeling.dlcm_replication import (
    _expand_heads,
    concept_attention_counted,
    concept_counts,
    concept_slot_weights,
    log_count_bias,
    preferred_form,
    replicate_concept_kv,
    replicated_concept_attention,
    replication_attention_mask,
    run_count_bias,
    update_concept_counts,
)
from hf_concept.modeling.packing import document_starts
from hf_concept.modeling.pooling import readable_concept_index
from hf_concept.reference.replication import concept_attention_loop
from tests.layouts import make_layout


def make_case(rows, num_heads=2, kv_heads=2, head_dim=4, null_concept=True, seed=0, dtype=torch.float64):
    """Left-padded rows of packed documents, random chunks, DLCM's readable index ("mean" pooling)."""
    generator = torch.Generator().manual_seed(seed)
    mask, boundaries, position_ids = make_layout(rows, generator, boundary_rate=0.4)
    length = mask.shape[1]
    starts = document_starts(mask, position_ids)
    index = readable_concept_index(boundaries, mask, starts, "mean")
    num_slots = int(index.max()) + 1
    if null_concept:
        # Slot 0 holds the learned null concept; concept m sits at slot m + 1.
        index, num_slots = index + 1, num_slots + 1
        index = index.masked_fill(~mask, -1)
    query_states = torch.randn(len(rows), num_heads, length, head_dim, generator=generator, dtype=dtype)
    concept_k = torch.randn(len(rows), kv_heads, num_slots, head_dim, generator=generator, dtype=dtype)
    concept_v = torch.randn(len(rows), kv_heads, num_slots, head_dim, generator=generator, dtype=dtype)
    return query_states, concept_k, concept_v, index, mask, starts


ROWS = [(0, [7, 5, 6]), (4, [14]), (9, [3, 6]), (18, [])]


def run_all_forms(query_states, concept_k, concept_v, index, mask, starts):
    counts = concept_counts(index, mask, starts, concept_k.shape[2])
    return {
        "replicated": replicated_concept_attention(query_states, concept_k, concept_v, index, mask, starts),
        "counted": concept_attention_counted(query_states, concept_k, concept_v, counts),
        "reference": concept_attention_loop(query_states, concept_k, concept_v, index, mask, starts),
    }


@pytest.mark.parametrize(
    ("num_heads", "kv_heads", "null_concept"), [(2, 2, True), (4, 2, True), (2, 2, False)]
)
def test_forms_match_reference_outputs_and_gradients(num_heads, kv_heads, null_concept):
    case = make_case(ROWS, num_heads, kv_heads, null_concept=null_concept)
    leaves = {
        name: [t.clone().requires_grad_(True) for t in case[:3]]
        for name in ("replicated", "counted", "reference")
    }
    outputs = {name: run_all_forms(*leaves[name], *case[3:])[name] for name in leaves}
    upstream = torch.randn_like(outputs["reference"])
    for name, output in outputs.items():
        (output * upstream).sum().backward()
        assert torch.isfinite(output).all(), name
    for name in ("replicated", "counted"):
        torch.testing.assert_close(outputs[name], outputs["reference"], rtol=1e-10, atol=1e-10)
        for fast, slow in zip(leaves[name], leaves["reference"], strict=True):
            torch.testing.assert_close(fast.grad, slow.grad, rtol=1e-10, atol=1e-10)
    # Pads and tokens with nothing to read get exact zeros.
    for name in ("replicated", "counted"):
        assert (outputs[name].detach().transpose(1, 2)[~case[4]] == 0).all()


def test_replicated_and_counted_agree_in_float32():
    case = make_case(
        [(3, [40, 25]), (0, [68])], num_heads=4, kv_heads=4, head_dim=16, dtype=torch.float32, seed=1
    )
    forms = run_all_forms(*case)
    torch.testing.assert_close(forms["replicated"], forms["counted"], rtol=0, atol=1e-5)


def test_causal_kernel_shortcut_equals_the_masked_form_on_one_unpadded_document():
    """`plain_causal=True` (no mask, SDPA's causal kernel) gives the reference's outputs and gradients."""
    case = make_case([(0, [37])], num_heads=4, kv_heads=2, head_dim=8, seed=3)
    assert case[4].all() and not case[5][:, 1:].any()
    fast = [t.clone().requires_grad_(True) for t in case[:3]]
    slow = [t.clone().requires_grad_(True) for t in case[:3]]
    output = replicated_concept_attention(*fast, *case[3:], plain_causal=True)
    expected = concept_attention_loop(*slow, *case[3:])
    torch.testing.assert_close(output, expected, rtol=1e-10, atol=1e-10)
    upstream = torch.randn_like(expected)
    (output * upstream).sum().backward()
    (expected * upstream).sum().backward()
    for mine, theirs in zip(fast, slow, strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-10, atol=1e-10)


def test_replication_is_repeat_interleave_of_concepts():
    concept_k = torch.randn(1, 2, 3, 4)
    concept_v = torch.randn(1, 2, 3, 4)
    lengths = torch.tensor([2, 1, 3])
    index = torch.repeat_interleave(torch.arange(3), lengths).unsqueeze(0)
    key_states, value_states = replicate_concept_kv(concept_k, concept_v, index)
    torch.testing.assert_close(key_states, torch.repeat_interleave(concept_k, lengths, dim=2))
    torch.testing.assert_close(value_states, torch.repeat_interleave(concept_v, lengths, dim=2))
    carried_nothing, _ = replicate_concept_kv(concept_k, concept_v, torch.tensor([[-1, 0]]))
    assert (carried_nothing[:, :, 0] == 0).all()
    with pytest.raises(ValueError, match="index"):
        replicate_concept_kv(concept_k, concept_v, torch.tensor([[3]]))


def test_left_padded_row_equals_row_alone_and_packed_equals_apart():
    query_states, concept_k, concept_v, index, mask, starts = make_case([(5, [6, 4, 7])], seed=2)
    packed = replicated_concept_attention(query_states, concept_k, concept_v, index, mask, starts)
    counts = concept_counts(index, mask, starts, concept_k.shape[2])
    counted = concept_attention_counted(query_states, concept_k, concept_v, counts)
    for begin, end in [(5, 22), (5, 11), (11, 15), (15, 22)]:
        piece = slice(begin, end)
        apart = replicated_concept_attention(
            query_states[:, :, piece], concept_k, concept_v, index[:, piece], mask[:, piece], starts[:, piece]
        )
        torch.testing.assert_close(packed[:, :, piece], apart)
        counts_apart = concept_counts(index[:, piece], mask[:, piece], starts[:, piece], concept_k.shape[2])
        torch.testing.assert_close(
            counted[:, :, piece],
            concept_attention_counted(query_states[:, :, piece], concept_k, concept_v, counts_apart),
        )
    assert (packed[:, :, :5] == 0).all()


def test_decoding_counts_follow_the_full_sequence():
    query_states, concept_k, concept_v, index, mask, starts = make_case(ROWS, seed=3)
    num_slots = concept_k.shape[2]
    full_counts = concept_counts(index, mask, starts, num_slots)
    full_attention = replicated_concept_attention(query_states, concept_k, concept_v, index, mask, starts)
    counts = torch.zeros(mask.shape[0], 0, dtype=torch.long)
    for position in range(mask.shape[1]):
        counts = update_concept_counts(counts, index[:, position], mask[:, position], starts[:, position])
        expected = full_counts[:, position, : counts.shape[1]]
        real = mask[:, position]
        assert torch.equal(counts[real], expected[real])
        assert (full_counts[real, position, counts.shape[1] :] == 0).all()
        step = concept_attention_counted(
            query_states[:, :, position : position + 1],
            concept_k[:, :, : counts.shape[1]],
            concept_v[:, :, : counts.shape[1]],
            counts.unsqueeze(1) * real.view(-1, 1, 1),
        )
        torch.testing.assert_close(step[:, :, 0], full_attention[:, :, position])


def test_counts_continue_across_calls():
    _, concept_k, _, index, mask, starts = make_case([(0, [9, 8])], seed=4)
    num_slots = concept_k.shape[2]
    full = concept_counts(index, mask, starts, num_slots)
    for cut in (3, 9, 12):
        later = slice(cut, None)
        # A continued call marks only position-id resets as starts, as document_starts(has_past=True) does.
        continued = concept_counts(
            index[:, later], mask[:, later], starts[:, later], num_slots, initial_counts=full[:, cut - 1]
        )
        torch.testing.assert_close(continued, full[:, later])


def test_causality_of_replicated_attention():
    query_states, concept_k, concept_v, index, mask, starts = make_case(ROWS, seed=5)
    reference = replicated_concept_attention(query_states, concept_k, concept_v, index, mask, starts)
    for position in (2, 7, 12):
        changed_queries = query_states.clone()
        changed_queries[:, :, position + 1 :] = torch.randn_like(changed_queries[:, :, position + 1 :])
        changed_index = index.clone()
        # Later positions carry other (still readable-looking) slots: nothing at <= position may move.
        changed_index[:, position + 1 :] = torch.where(mask[:, position + 1 :], 0, -1)
        changed = replicated_concept_attention(
            changed_queries, concept_k, concept_v, changed_index, mask, starts
        )
        torch.testing.assert_close(
            changed[:, :, : position + 1], reference[:, :, : position + 1], rtol=0, atol=0
        )


def test_bad_inputs_raise_value_errors():
    query_states, concept_k, concept_v, index, mask, starts = make_case(ROWS, num_heads=3, kv_heads=2)
    with pytest.raises(ValueError, match="heads"):
        replicated_concept_attention(query_states, concept_k, concept_v, index, mask, starts)
    counts = concept_counts(index, mask, starts, concept_k.shape[2])
    with pytest.raises(ValueError, match="counts"):
        concept_attention_counted(query_states[:, :2], concept_k, concept_v, counts[..., :-1])


def test_varlen_form_equals_the_reference_on_padded_packed_rows():
    """The varlen packing (one sequence per document, pads dropped) with `varlen_reference` for torch's
    kernel gives the loop reference's outputs and gradients; only the CUDA kernel itself is not run here."""
    from hf_concept.modeling.dlcm_replication import replicated_concept_attention_varlen
    from hf_concept.modeling.varlen import varlen_reference as sdpa_varlen

    case = make_case(ROWS, num_heads=4, kv_heads=2, head_dim=8, seed=5)
    fast = [t.clone().requires_grad_(True) for t in case[:3]]
    slow = [t.clone().requires_grad_(True) for t in case[:3]]
    output = replicated_concept_attention_varlen(*fast, *case[3:], varlen_kernel=sdpa_varlen)
    expected = concept_attention_loop(*slow, *case[3:])
    torch.testing.assert_close(output, expected, rtol=1e-10, atol=1e-10)
    upstream = torch.randn_like(expected)
    (output * upstream).sum().backward()
    (expected * upstream).sum().backward()
    for mine, theirs in zip(fast, slow, strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-10, atol=1e-10)
    no_null = make_case(ROWS, null_concept=False)
    with pytest.raises(ValueError, match="carry a concept"):
        replicated_concept_attention_varlen(*no_null, varlen_kernel=sdpa_varlen)


@pytest.mark.parametrize("seed", range(4))
def test_the_run_bias_equals_the_log_of_the_cumulative_counts(seed):
    """The fresh-call bias built from each slot's run equals log(count) of the cumulative one-hot counts
    exactly (null concept repeated per document, left pads, packed rows), and so does what it sees."""
    for rows, null_concept in (([*ROWS, (2, [1, 1, 4])], True), (ROWS, False), ([(0, [9]), (3, [6])], True)):
        _, _, _, index, mask, starts = make_case(rows, seed=seed, null_concept=null_concept)
        num_slots = int(index.max()) + 1
        bias, sees = run_count_bias(index, mask, starts, num_slots)
        expected_bias, expected_sees = log_count_bias(concept_counts(index, mask, starts, num_slots))
        assert torch.equal(sees, expected_sees)
        assert torch.equal(bias, expected_bias)


def test_the_automatic_form_follows_the_measured_crossover():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert preferred_form(cuda, 8192, 2049, training=True) == "replicated"
    # R = 4 and 8: counted at every measured length; R = 2: counted for training up to 4k, inference to 1k.
    for length in (1024, 2048, 4096, 8192):
        for ratio in (4, 8):
            for training in (True, False):
                assert preferred_form(cpu, length, length // ratio + 1, training) == "counted"
    chosen = {(length, training): preferred_form(cpu, length, length // 2 + 1, training)
              for length in (1024, 2048, 4096, 8192) for training in (True, False)}  # fmt: skip
    assert [form for (_, training), form in sorted(chosen.items()) if training] == ["counted"] * 3 + [
        "replicated"
    ]
    assert [form for (_, training), form in sorted(chosen.items()) if not training] == ["counted"] + [
        "replicated"
    ] * 3


@pytest.mark.parametrize(("num_heads", "kv_heads"), [(2, 2), (4, 2)])
def test_slot_weights_are_the_replicated_weights_summed_per_slot(num_heads, kv_heads):
    """What `output_attentions` reports for DLCM's cross-attention: per slot, the replicated form's
    softmax over positions summed over the positions that carry the slot (both biases give it)."""
    query_states, concept_k, _, index, mask, starts = make_case(ROWS, num_heads, kv_heads, seed=3)
    num_slots = concept_k.shape[2]
    keys, _ = replicate_concept_kv(
        _expand_heads(concept_k, num_heads), _expand_heads(concept_k, num_heads), index
    )
    allowed = replication_attention_mask(index, mask, starts)
    scores = (query_states @ keys.transpose(2, 3)) * query_states.shape[-1] ** -0.5
    per_position = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
    # (B, L, N): which slot each position carries
    carried = torch.nn.functional.one_hot(index.clamp(min=0), num_slots).to(per_position.dtype)
    expected = per_position @ (carried * (index >= 0)[..., None])[:, None]
    for bias, sees in (
        run_count_bias(index, mask, starts, num_slots, torch.float64),
        log_count_bias(concept_counts(index, mask, starts, num_slots), torch.float64),
    ):
        torch.testing.assert_close(concept_slot_weights(query_states, concept_k, bias, sees), expected)
