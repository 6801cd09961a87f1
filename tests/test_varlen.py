"""The varlen attention implementation ("hf_concept_varlen", `modeling/varlen.py`).

On CPU: the bookkeeping (segments, cumulative lengths, longest segments, windows, GQA grouping, packing
round trip) against hand-made cases and the masked reference, and every family's forward with
`varlen_reference` substituted for the kernel against its sdpa logits. On CUDA (skipped elsewhere): torch's
kernel itself against the reference and each family's varlen path against sdpa and eager.
"""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from hf_concept.modeling import dlcm_replication, varlen
from hf_concept.modeling.varlen import (
    VARLEN_ATTENTION,
    VarlenLayout,
    gqa_groups,
    layout_from_mask,
    layout_from_position_ids,
    layout_mask,
    pack,
    unpack,
    use_varlen_kernel,
    varlen_attention_forward,
    varlen_reference,
    window_size_for,
)
from tests.conformance import families

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's varlen kernel needs CUDA")


class Module(torch.nn.Module):
    """What transformers' attention functions read from the calling module."""

    def __init__(self, num_heads: int, kv_heads: int) -> None:
        super().__init__()
        self.is_causal = True
        self.num_key_value_groups = num_heads // kv_heads


def counting(kernel):
    """`kernel` that counts its calls in `.calls`."""

    def run(*args, **kwargs):
        run.calls += 1
        return kernel(*args, **kwargs)

    run.calls = 0
    return run


def test_layout_from_position_ids_splits_packed_documents_and_drops_pads():
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0], [5, 5, 0, 1, 2, 3]])
    attention_mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
    layout = layout_from_position_ids(position_ids, attention_mask, sliding_window=3)
    assert layout.cu_seq_q.tolist() == [0, 3, 5, 6, 10]
    assert layout.cu_seq_q.dtype == torch.int32
    assert layout.query_positions.tolist() == [0, 1, 2, 3, 4, 5, 8, 9, 10, 11]
    assert (layout.max_q, layout.max_k, layout.num_segments) == (4, 4, 4)
    assert layout.window_size == (2, 0)
    assert torch.equal(layout.key_positions, layout.query_positions)


def test_window_sizes_and_gqa_grouping():
    assert window_size_for(None) == (-1, 0)
    assert window_size_for(1) == (0, 0)
    assert window_size_for(4096) == (4095, 0)
    with pytest.raises(ValueError, match="sliding_window"):
        window_size_for(0)
    assert gqa_groups(8, 2) == 4
    assert gqa_groups(4, 4) == 1
    with pytest.raises(ValueError, match="multiple"):
        gqa_groups(6, 4)


def test_pack_and_unpack_round_trip_the_real_positions():
    states = torch.randn(2, 3, 5, 4)  # (B, X, L, K)
    positions = torch.tensor([1, 2, 3, 5, 9])
    packed = pack(states, positions)  # (N, X, K)
    assert packed.shape == (5, 3, 4)
    assert torch.equal(packed[3], states[1, :, 0])
    restored = unpack(packed, positions, 2, 5)  # (B, L, X, K)
    flat = states.transpose(1, 2).reshape(10, 3, 4)
    kept = torch.zeros(10, dtype=torch.bool)
    kept[positions] = True
    assert torch.equal(restored.reshape(10, 3, 4)[kept], flat[kept])
    assert not restored.reshape(10, 3, 4)[~kept].any()


def random_layout(generator: torch.Generator, batch: int, length: int, offset: int, window: int | None):
    """A (B, Lq = length, Lk = length + offset) layout: rows of left pads, packed documents, and (with a
    cache offset) one document per row continuing over the cached keys, as cache steps have."""
    real = torch.ones(batch, length + offset, dtype=torch.bool)
    starts = torch.zeros_like(real)
    for row in range(batch):
        pads = int(torch.randint(0, length // 2, (1,), generator=generator))
        real[row, :pads] = False
        if offset == 0:
            cuts = torch.randint(pads, length, (2,), generator=generator)
            starts[row, cuts] = True
    keys = varlen.layout_from_documents(real, starts, window)
    if offset == 0:
        return keys
    # Queries: the last `length` positions of each row (all real here).
    queries = (torch.arange(batch)[:, None] * length + torch.arange(length)).reshape(-1)
    cu_q = torch.arange(batch + 1, dtype=torch.int32) * length
    return VarlenLayout(
        queries, keys.key_positions, cu_q, keys.cu_seq_k, length, keys.max_k, keys.window_size
    )


@pytest.mark.parametrize("offset", [0, 3])
@pytest.mark.parametrize("window", [None, 1, 3])
def test_the_layout_read_off_its_own_mask_is_the_same_layout(offset, window):
    generator = torch.Generator().manual_seed(7 + offset)
    for _ in range(5):
        layout = random_layout(generator, 3, 9, offset, window)
        mask = layout_mask(layout, 3, 9, 9 + offset)
        derived = layout_from_mask(mask)
        assert torch.equal(layout_mask(derived, 3, 9, 9 + offset), mask)
        if window != 1:
            # A one-key window reads the same under any split; otherwise the split itself is recovered.
            assert torch.equal(derived.cu_seq_q, layout.cu_seq_q)
            assert torch.equal(derived.query_positions, layout.query_positions)
            assert derived.max_q == layout.max_q
        if window is None or (offset == 0 and window != 1):
            # (Cached keys that no query's window reaches are left out of the derived layout.)
            assert torch.equal(derived.cu_seq_k, layout.cu_seq_k)
            assert torch.equal(derived.key_positions, layout.key_positions)
            assert derived.max_k == layout.max_k


def qkv(batch: int, query_length: int, key_length: int, heads: int, kv_heads: int, dtype=torch.float32):
    generator = torch.Generator().manual_seed(3)
    query = torch.randn(batch, heads, query_length, 8, generator=generator, dtype=dtype)
    key = torch.randn(batch, kv_heads, key_length, 8, generator=generator, dtype=dtype)
    value = torch.randn(batch, kv_heads, key_length, 8, generator=generator, dtype=dtype)
    return query, key, value


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("window", [None, 2, 5])
@pytest.mark.parametrize("offset", [0, 4])
def test_the_path_with_the_reference_kernel_equals_masked_sdpa(heads, kv_heads, window, offset):
    """Packed rows, pads, windows, GQA and cache steps: `varlen_attention_forward` on the reference
    kernel gives sdpa's output under the same mask at every real query (fp32, 1e-5)."""
    generator = torch.Generator().manual_seed(heads + kv_heads + offset)
    layout = random_layout(generator, 3, 10, offset, window)
    mask = layout_mask(layout, 3, 10, 10 + offset)
    query, key, value = qkv(3, 10, 10 + offset, heads, kv_heads)
    module = Module(heads, kv_heads)
    expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    kernel = counting(varlen_reference)
    with use_varlen_kernel(kernel):
        output, weights = varlen_attention_forward(module, query, key, value, mask, scaling=0.3)
    assert kernel.calls == 1 and weights is None
    real = mask[:, 0].any(-1)  # (B, Lq)
    torch.testing.assert_close(output[real], expected[real], atol=1e-5, rtol=1e-5)
    assert not output[~real].any()


def test_no_mask_reads_as_causal_rows_or_packed_position_ids():
    query, key, value = qkv(2, 6, 6, 4, 2)
    module = Module(4, 2)
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5]])
    packed_mask = layout_mask(layout_from_position_ids(position_ids), 2, 6, 6)
    with use_varlen_kernel(varlen_reference):
        plain, _ = varlen_attention_forward(module, query, key, value, None)
        packed, _ = varlen_attention_forward(module, query, key, value, None, position_ids=position_ids)
        # One new token over cached keys reads them all, as sdpa does without a mask.
        step, _ = varlen_attention_forward(module, query[:, :, -1:], key, value, None)
    torch.testing.assert_close(plain, sdpa_attention_forward(module, query, key, value, None)[0])
    torch.testing.assert_close(packed, sdpa_attention_forward(module, query, key, value, packed_mask)[0])
    torch.testing.assert_close(step, sdpa_attention_forward(module, query[:, :, -1:], key, value, None)[0])


@contextlib.contextmanager
def fallback_reasons():
    """The reasons `warn_fallback` gives inside the block (the warning itself is shown once per reason)."""
    reasons = []
    original = varlen.warn_fallback
    varlen.warn_fallback = lambda reason: reasons.append(reason) or original(reason)
    try:
        yield reasons
    finally:
        varlen.warn_fallback = original


def test_masks_the_kernel_cannot_express_fall_back_to_sdpa_once_named():
    query, key, value = qkv(1, 6, 6, 4, 2)
    module = Module(4, 2)
    # Hidden Decoding's token_block shape: a query reads the later positions of its own block.
    blocks = torch.arange(6) // 2
    block_mask = (blocks[None, :] <= blocks[:, None])[None, None]
    bias = torch.zeros(1, 1, 6, 6).masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), -1e30)
    bias[0, 0, 3, 1] = 0.5
    kernel = counting(varlen_reference)
    with fallback_reasons() as reasons, use_varlen_kernel(kernel):
        for mask in (block_mask, bias):
            output, _ = varlen_attention_forward(module, query, key, value, mask)
            torch.testing.assert_close(output, sdpa_attention_forward(module, query, key, value, mask)[0])
        varlen_attention_forward(module, query, key, value, None, dropout=0.1)
    assert kernel.calls == 0
    assert [reason.split(" ")[1] for reason in reasons] == ["mask", "float", "has"]


def test_on_cpu_without_a_kernel_it_computes_sdpa_and_warns():
    query, key, value = qkv(1, 5, 5, 4, 2)
    module = Module(4, 2)
    with fallback_reasons() as reasons:
        output, _ = varlen_attention_forward(module, query, key, value, None)
    torch.testing.assert_close(output, sdpa_attention_forward(module, query, key, value, None)[0])
    assert reasons == ["varlen_attn runs on CUDA in fp16/bf16 only (got cpu, torch.float32)"]


def test_an_older_torch_kernel_signature_is_adapted(monkeypatch):
    """A `varlen_attn` without enable_gqa, scale or window_size (older torch releases) still computes the
    same causal attention (heads repeated, scale folded into the queries), and windows fall back."""
    # A torch without the module (2.9 has none) takes the fallback that another test covers.
    torch_varlen = pytest.importorskip("torch.nn.attention.varlen", reason="this torch has no varlen_attn")

    def older(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False):
        assert is_causal and query.shape[1] == key.shape[1]
        window = (-1, 0)
        return varlen_reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size=window)

    monkeypatch.setattr(torch_varlen, "varlen_attn", older)
    varlen.torch_kernel.cache_clear()
    monkeypatch.setattr(varlen, "kernel_for", lambda query: varlen.torch_kernel())
    try:
        module = Module(4, 2)
        layout = random_layout(torch.Generator().manual_seed(1), 2, 8, 0, None)
        mask = layout_mask(layout, 2, 8, 8)
        query, key, value = qkv(2, 8, 8, 4, 2)
        output, _ = varlen_attention_forward(module, query, key, value, mask, scaling=0.2)
        expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.2)
        real = mask[:, 0].any(-1)
        torch.testing.assert_close(output[real], expected[real], atol=1e-5, rtol=1e-5)
        windowed = layout_mask(random_layout(torch.Generator().manual_seed(1), 2, 8, 0, 3), 2, 8, 8)
        with fallback_reasons() as reasons:
            varlen_attention_forward(module, query, key, value, windowed)
        assert reasons and "takes no window_size" in reasons[0]
    finally:
        varlen.torch_kernel.cache_clear()


def test_it_is_registered_the_transformers_way():
    assert ALL_ATTENTION_FUNCTIONS[VARLEN_ATTENTION] is varlen_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    assert VARLEN_ATTENTION in ALL_MASK_ATTENTION_FUNCTIONS


def test_a_remote_code_copy_of_the_module_leaves_the_first_registration(monkeypatch):
    """A checkpoint loaded with trust_remote_code brings its own copy of varlen.py (under
    transformers_modules): importing it must not re-point the registry, or patches of this module's
    kernel (and the tests below, when they run after such a load) stop taking effect."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("remote_copy_of_varlen", varlen.__file__)
    copy = importlib.util.module_from_spec(spec)
    # Registered while it runs, as an import would (its dataclasses look their module up).
    monkeypatch.setitem(sys.modules, spec.name, copy)
    spec.loader.exec_module(copy)
    assert copy.varlen_attention_forward is not varlen_attention_forward
    assert ALL_ATTENTION_FUNCTIONS[VARLEN_ATTENTION] is varlen_attention_forward


FAMILY_CASES = {
    "plain": (families._plain_class, families._plain_config),
    "conceptmoe": (families._conceptmoe_class, families._conceptmoe_config),
    "dlcm": (families._dlcm_class, families._dlcm_config),
    "hidden_decoding": (families._hidden_decoding_class, families._hidden_decoding_config),
}


def family_model(family: str, implementation: str = "sdpa", **overrides):
    model_class, make_config = FAMILY_CASES[family]
    torch.manual_seed(0)
    return model_class()._from_config(make_config(**overrides), attn_implementation=implementation).eval()


def padded_and_packed_batches(length: int = 12) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(11)
    input_ids = torch.randint(3, 97, (2, length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :3] = 0
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])
    return [
        dict(input_ids=input_ids, attention_mask=attention_mask),
        dict(input_ids=input_ids[:1], position_ids=position_ids),
    ]


@pytest.mark.parametrize("family", sorted(FAMILY_CASES))
def test_every_family_on_the_reference_kernel_gives_its_sdpa_logits(family):
    """Token layers, concept layers over packed concept sequences, DLCM's replicated cross-attention,
    Hidden Decoding's intra-stream and windowed layers: the varlen path with the reference kernel equals
    the model's masked sdpa logits at every real token (fp32, 1e-5), padded and packed."""
    overrides = {"cross_attention_form": "replicated"} if family == "dlcm" else {}
    model = family_model(family, **overrides)
    kernel = counting(varlen_reference)
    for batch in padded_and_packed_batches():
        model.set_attn_implementation("sdpa")
        with torch.no_grad():
            expected = model(**batch).logits
        model.set_attn_implementation(VARLEN_ATTENTION)
        with torch.no_grad(), use_varlen_kernel(kernel):
            output = model(**batch).logits
        real = batch.get("attention_mask", torch.ones_like(batch["input_ids"])).bool()
        torch.testing.assert_close(output[real], expected[real], atol=1e-5, rtol=1e-5)
    assert kernel.calls > 0


@pytest.mark.parametrize("family", ["plain", "conceptmoe", "dlcm"])
def test_cached_greedy_generation_on_the_reference_kernel_equals_sdpa(family):
    model = family_model(family)
    batch = padded_and_packed_batches()[0]
    settings = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    expected = model.generate(**batch, **settings)
    model.set_attn_implementation(VARLEN_ATTENTION)
    kernel = counting(varlen_reference)
    with use_varlen_kernel(kernel):
        output = model.generate(**batch, **settings)
    assert torch.equal(output, expected)
    assert kernel.calls > 0


def test_hidden_decoding_token_block_layers_fall_back_with_their_reason():
    model = family_model("hidden_decoding", cross_stream_mask="token_block", sliding_window=6)
    batch = padded_and_packed_batches()[0]
    with torch.no_grad():
        expected = model(**batch).logits
    model.set_attn_implementation(VARLEN_ATTENTION)
    with fallback_reasons() as reasons, torch.no_grad(), use_varlen_kernel(varlen_reference):
        output = model(**batch).logits
    torch.testing.assert_close(
        output[batch["attention_mask"].bool()], expected[batch["attention_mask"].bool()]
    )
    assert any("not causal within contiguous segments" in reason for reason in reasons)


def test_dlcm_auto_form_keeps_cpu_and_reads_the_cuda_table(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert dlcm_replication.preferred_form(cpu, 4096, 512, True) == "counted"
    assert dlcm_replication.preferred_form(cpu, 8192, 4096, True) == "replicated"
    assert dlcm_replication.preferred_form(cuda, 8192, 2048, True) == "replicated"
    monkeypatch.setattr(dlcm_replication, "CUDA_MEASURED_FORMS", ((16384, 3.0, True, "counted"),))
    assert dlcm_replication.preferred_form(cuda, 8192, 2048, True) == "counted"
    assert dlcm_replication.preferred_form(cuda, 8192, 4096, True) == "replicated"
    assert dlcm_replication.preferred_form(cuda, 8192, 2048, False) == "replicated"


@CUDA
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 16])
def test_torch_kernel_equals_the_reference_on_cuda(dtype, window):
    """torch's varlen kernel against the per-segment reference in fp32 on the same packed layout (packed
    documents, pads, a window, GQA), within the half-precision rounding of the inputs."""
    generator = torch.Generator().manual_seed(5)
    layout = random_layout(generator, 4, 96, 0, window)
    layout = VarlenLayout(*(t.cuda() if torch.is_tensor(t) else t for t in vars(layout).values()))
    query, key, value = (t.cuda() for t in qkv(4, 96, 96, 8, 2, dtype))
    module = Module(8, 2)
    mask = layout_mask(layout, 4, 96, 96)
    output, _ = varlen_attention_forward(module, query, key, value, mask, scaling=0.125)
    expected, _ = sdpa_attention_forward(
        module, query.float(), key.float(), value.float(), mask, scaling=0.125
    )
    real = mask[:, 0].any(-1)
    torch.testing.assert_close(output[real].float(), expected[real], atol=2e-2, rtol=2e-2)


@CUDA
@pytest.mark.parametrize("family", sorted(FAMILY_CASES))
def test_every_family_on_the_cuda_kernel_matches_sdpa_and_eager(family):
    """The real kernel in bf16 against sdpa in bf16 and eager in fp32: within twice sdpa's own spread."""
    overrides = {"cross_attention_form": "replicated"} if family == "dlcm" else {}
    model = family_model(family, "eager", **overrides).cuda()
    batch = {key: value.cuda() for key, value in padded_and_packed_batches()[0].items()}
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        reference = model(**batch).logits[real]
        model.to(torch.bfloat16)
        model.set_attn_implementation("sdpa")
        sdpa = model(**batch).logits[real].float()
        model.set_attn_implementation(VARLEN_ATTENTION)
        output = model(**batch).logits[real].float()
    spread = (sdpa - reference).abs().max()
    assert (output - reference).abs().max() <= 2 * spread + 1e-2


@CUDA
def test_the_cuda_kernel_backpropagates_like_the_reference():
    generator = torch.Generator().manual_seed(9)
    layout = random_layout(generator, 2, 64, 0, None)
    mask = layout_mask(layout, 2, 64, 64).cuda()
    module = Module(4, 2)
    tensors = [t.cuda().requires_grad_(True) for t in qkv(2, 64, 64, 4, 2, torch.bfloat16)]
    output, _ = varlen_attention_forward(module, *tensors, mask)
    real = mask[:, 0].any(-1)
    output[real].float().square().sum().backward()
    grads = [t.grad.float() for t in tensors]
    reference = [t.detach().float().requires_grad_(True) for t in tensors]
    expected, _ = sdpa_attention_forward(module, *reference, mask)
    expected[real].square().sum().backward()
    for mine, theirs in zip(grads, reference, strict=True):
        torch.testing.assert_close(mine, theirs.grad, atol=5e-2, rtol=5e-2)
