"""Transformer building blocks shared by every hf_concept family.

Legend: B batch, L tokens, D width (hidden size), H query heads, G key/value heads, K head dim,
E experts, N flattened tokens (B·L), I intermediate width.

Contract:
- Shapes: token states are (B, L, D) in and out of every block; attention works on (B, H, L, K).
- Causality: `Attention` itself is mask-driven. It attends wherever `attention_mask` allows (an additive
  float mask for eager, boolean or None for sdpa, 2-D or None for flash), so causality, left padding,
  sliding windows and packed documents all come from the mask the caller builds with
  `transformers.masking_utils`. Nothing in this file mixes information across positions otherwise:
  norms, MLPs and the MoE block act on each token alone.
- Attention weights (`output_attentions=True`) are recorded by `AttentionRecorder`, only under the eager
  kernel, the one that computes them; a caller that asks for them under another kernel gets a warning and
  an empty tuple, as transformers' own models do.
- Numerics follow transformers 5.23's Llama/Mistral/Qwen2/Qwen3/Mixtral/Qwen-MoE code (RMSNorm in fp32,
  rotate-half RoPE, softmax in fp32, top-k routing on fp32 probabilities), so that weights loaded from
  those checkpoints give the same logits.

Config attributes read (duck-typed, so other families can pass their own config objects):
hidden_size, num_attention_heads, num_key_value_heads, head_dim, rms_norm_eps, hidden_act,
attention_dropout, _attn_implementation; optional (with defaults): attention_bias, attention_output_bias,
qk_norm, layer_types, sliding_window, mlp_bias, num_experts, num_experts_per_tok, moe_intermediate_size,
shared_expert_intermediate_size, norm_topk_prob, decoder_sparse_step, mlp_only_layers, intermediate_size.
A stack of another width or other heads than its model (a concept stack, LSLM's stages) passes a
`ConfigView`: the model's config with those fields overridden, every other attribute — `_attn_implementation`
included — read live from the model's.

Every family's backbone also takes from here its default RoPE positions (`default_position_ids`) and the
initialisation of these blocks' weights (`init_backbone_weights`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import logging

from .transformers_compat import layer_cache

# Importing it registers the varlen attention implementation ("hf_concept_varlen") with transformers.
from .varlen import VARLEN_ATTENTION  # noqa: F401

logger = logging.get_logger(__name__)

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, computed in fp32 and cast back (as Llama)."""

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        input_dtype = states.dtype
        states = states.to(torch.float32)
        variance = states.pow(2).mean(-1, keepdim=True)
        states = states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * states.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


def _rope_exponents(head_dim: int) -> torch.Tensor:
    # 2i / K for i < K/2, in fp32 as every transformers RoPE variant computes it.
    return torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim


def _llama3_inverse_frequencies(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth blend in between."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    original_length = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    long_wavelength = original_length / low_freq_factor
    short_wavelength = original_length / high_freq_factor
    scaled = torch.where(wavelength > long_wavelength, inv_freq / factor, inv_freq)
    smooth = (original_length / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelength >= short_wavelength) & (wavelength <= long_wavelength)
    return torch.where(is_medium, blended, scaled)


def _yarn_attention_factor(factor: float, scaling: dict[str, Any]) -> float:
    """YaRN's cos/sin multiplier: explicit, or 0.1·m·ln(factor) + 1 (a ratio of two when mscales are set)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def magnitude(scale: float, multiplier: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * multiplier * math.log(scale) + 1.0

    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(magnitude(factor, mscale) / magnitude(factor, mscale_all_dim))
    return magnitude(factor)


def _yarn_inverse_frequencies(
    head_dim: int, rope_theta: float, scaling: dict[str, Any], max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies by `factor`, keep high ones, ramp linearly between two dims."""
    original_length = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position_embeddings / original_length
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        # The dimension whose wavelength fits `rotations` times into the original context.
        return head_dim * math.log(original_length / (rotations * 2 * math.pi)) / (2 * math.log(rope_theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep_weight = 1 - ramp
    wavelengths = rope_theta ** _rope_exponents(head_dim)
    kept = 1.0 / wavelengths
    interpolated = 1.0 / (factor * wavelengths)
    inv_freq = interpolated * (1 - keep_weight) + kept * keep_weight
    return inv_freq, _yarn_attention_factor(factor, scaling)


def rope_inverse_frequencies(
    head_dim: int,
    rope_theta: float,
    rope_scaling: dict[str, Any] | None = None,
    max_position_embeddings: int | None = None,
) -> tuple[torch.Tensor, float]:
    """(K/2,) fp32 inverse frequencies and the cos/sin multiplier for one RoPE variant.

    `rope_scaling` is None or a dict with `rope_type` in `ROPE_TYPES` and that type's fields (transformers'
    names: factor, low_freq_factor, high_freq_factor, original_max_position_embeddings, attention_factor,
    beta_fast, beta_slow, mscale, mscale_all_dim, truncate).
    """
    rope_type = (rope_scaling or {}).get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_scaling.rope_type={rope_type!r} is not supported; choose one of {ROPE_TYPES}")
    inv_freq = 1.0 / (rope_theta ** _rope_exponents(head_dim))
    if rope_type == "linear":
        return inv_freq / rope_scaling["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inverse_frequencies(inv_freq, rope_scaling), 1.0
    if rope_type == "yarn":
        return _yarn_inverse_frequencies(head_dim, rope_theta, rope_scaling, max_position_embeddings)
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    """cos/sin tables for rotate-half RoPE, from explicit fields (never transformers' `rope_parameters`).

    `inv_freq` is a non-persistent buffer: `from_pretrained` leaves it uninitialised, so the model's
    `_init_weights` calls `reset_inv_freq()`.
    """

    def __init__(
        self,
        head_dim: int,
        rope_theta: float = 10000.0,
        rope_scaling: dict[str, Any] | None = None,
        max_position_embeddings: int | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rope_theta = rope_theta
        self.rope_scaling = dict(rope_scaling) if rope_scaling else None
        self.max_position_embeddings = max_position_embeddings
        inv_freq, self.attention_scaling = self.compute_inv_freq()
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @classmethod
    def from_config(cls, config) -> RotaryEmbedding:
        return cls(config.head_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings)

    def compute_inv_freq(self) -> tuple[torch.Tensor, float]:
        return rope_inverse_frequencies(
            self.head_dim, self.rope_theta, self.rope_scaling, self.max_position_embeddings
        )

    @torch.no_grad()
    def reset_inv_freq(self) -> None:
        """Recompute the buffer (fp32, on its current device): after meta-device loading it holds garbage."""
        inv_freq, self.attention_scaling = self.compute_inv_freq()
        self.inv_freq = inv_freq.to(self.inv_freq.device)

    @torch.no_grad()
    def forward(self, states: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape (B or 1, L, K) in `states.dtype`, from (B or 1, L) position ids."""
        inv_freq = self.inv_freq.to(device=states.device, dtype=torch.float32)
        # (B, L, K/2)
        angles = position_ids[..., None].float() * inv_freq
        # (B, L, K)
        angles = torch.cat((angles, angles), dim=-1)
        cos = angles.cos() * self.attention_scaling
        sin = angles.sin() * self.attention_scaling
        return cos.to(states.dtype), sin.to(states.dtype)


def default_position_ids(
    attention_mask: torch.Tensor | None, length: int, past_length: int, device: torch.device
) -> torch.Tensor:
    """(B or 1, L) positions: counted over real tokens when a 2-D mask covers past and new tokens."""
    if (
        attention_mask is not None
        and attention_mask.dim() == 2
        and attention_mask.shape[-1] == past_length + length
    ):
        positions = attention_mask.long().cumsum(-1) - 1
        # (B, L); pads get 0, they are masked as keys and their own outputs are meaningless.
        return positions.clamp(min=0)[:, -length:].to(device)
    return (torch.arange(length, device=device) + past_length).unsqueeze(0)


def rotate_half(states: torch.Tensor) -> torch.Tensor:
    first, second = states.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate (B, H, L, K) queries and (B, G, L, K) keys by (B, L, K) cos/sin (heads broadcast)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return query * cos + rotate_half(query) * sin, key * cos + rotate_half(key) * sin


def repeat_kv(states: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, G, L, K) -> (B, G·groups, L, K), each key/value head repeated for its query heads."""
    if groups == 1:
        return states
    batch, kv_heads, length, head_dim = states.shape
    expanded = states[:, :, None].expand(batch, kv_heads, groups, length, head_dim)
    return expanded.reshape(batch, kv_heads * groups, length, head_dim)


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain softmax attention: (B, H, L, K) query, (B, G, S, K) key/value -> (B, L, H, K), weights.

    `attention_mask` is additive (B, 1, L, S) float (as `masking_utils` builds it for eager) or boolean
    (True = may attend).
    """
    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    # (B, H, L, S)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attention_mask
    weights = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    # (B, L, H, K)
    output = torch.matmul(weights, value).transpose(1, 2).contiguous()
    return output, weights


class AttentionRecorder:
    """The attention weights of one forward, for `output_attentions=True`.

    `recording_attentions(model, recorder)` hands the recorder to every module of `model` that has an
    `attention_recorder` attribute (the attention modules) for the length of a block; each run of such a
    module then records its weights. `entries(modules)` lays them out in the family's documented order.
    `enabled` is False where the kernel computes no weights (not eager): nothing is recorded and
    `entries` is the empty tuple, what transformers' models return there. The recorder lives on the
    modules while the block runs, so one model object must not run a recorded and another forward at
    the same time from two threads.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.runs: dict[int, list[torch.Tensor | None]] = {}
        # Per module (by id): a function (weights) -> (entry, used) that records `entry` in another layout
        # and gives the weights the module goes on with (LSLM's token-aligned rows).
        self.layouts: dict[int, Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = {}
        self.in_graph = True

    def lay_out(self, modules: Iterable[nn.Module], layout: Callable, in_graph: bool = True) -> None:
        """Record the weights of `modules` as `layout(weights)[0]`. With `in_graph` the modules go on
        with `layout(weights)[1]` (equal in value), so the recorded entry is part of the graph; without,
        the entry is a copy beside it (gradient checkpointing recomputes the layers unrecorded)."""
        for module in modules:
            self.layouts[id(module)] = layout
        self.in_graph = in_graph

    def record(self, module: nn.Module, weights: torch.Tensor | None) -> torch.Tensor | None:
        """Record `module`'s weights of one run; -> the weights the module goes on with."""
        layout = self.layouts.get(id(module))
        if layout is None or weights is None:
            self.runs.setdefault(id(module), []).append(weights)
            return weights
        # Outside the graph the entry is computed without one: a checkpointed layer's recomputation (run
        # unrecorded) must save the tensors its recorded forward saved.
        with torch.set_grad_enabled(self.in_graph and torch.is_grad_enabled()):
            entry, used = layout(weights)
        self.runs.setdefault(id(module), []).append(entry)
        return used if self.in_graph else weights

    def entries(self, modules: Iterable[nn.Module]) -> tuple[torch.Tensor | None, ...]:
        """One entry per element of `modules`: that module's weights, in run order for a module listed k
        times (its first k runs), None where it did not run; the empty tuple when not `enabled`."""
        if not self.enabled:
            return ()
        taken: dict[int, int] = {}
        result = []
        for module in modules:
            runs = self.runs.get(id(module), [])
            index = taken.get(id(module), 0)
            taken[id(module)] = index + 1
            result.append(runs[index] if index < len(runs) else None)
        return tuple(result)


def attention_recorder(config, output_attentions: bool | None) -> AttentionRecorder | None:
    """A recorder when attentions are asked for (`output_attentions`, else `config.output_attentions`),
    None when not. Only the eager kernel computes weights: under another one the recorder is disabled
    and a warning (once) says so, as transformers' sdpa kernel does."""
    wanted = getattr(config, "output_attentions", False) if output_attentions is None else output_attentions
    if not wanted:
        return None
    implementation = config._attn_implementation
    if implementation != "eager":
        logger.warning_once(
            f"output_attentions=True returns no attention weights under attn_implementation="
            f"{implementation!r} (attentions is an empty tuple): load the model with "
            "attn_implementation='eager' or call model.set_attn_implementation('eager')."
        )
    return AttentionRecorder(enabled=implementation == "eager")


@contextmanager
def recording_attentions(model: nn.Module, recorder: AttentionRecorder | None) -> Iterator[None]:
    """Hand `recorder` to the attention modules of `model` for the block; nothing when it is None or
    disabled, so a forward that asks for no weights runs exactly as before."""
    if recorder is None or not recorder.enabled:
        yield
        return
    modules = [module for module in model.modules() if hasattr(module, "attention_recorder")]
    for module in modules:
        module.attention_recorder = recorder
    try:
        yield
    finally:
        for module in modules:
            module.attention_recorder = None


class ConfigView:
    """`config` with `overrides` (e.g. hidden_size=...) on top; everything else read live from `config`."""

    def __init__(self, config: Any, **overrides: Any) -> None:
        self._config = config
        self.__dict__.update(overrides)

    def __getattr__(self, name: str) -> Any:
        # Only reached for names not set here. A copy or unpickle builds the object without __init__ and
        # probes it (`__setstate__`, `__deepcopy__`) before `_config` is set: those probes must fail
        # plainly, not recurse through this method.
        config = self.__dict__.get("_config")
        if config is None:
            raise AttributeError(name)
        return getattr(config, name)


def layer_type_of(config, layer_idx: int) -> str:
    layer_types = getattr(config, "layer_types", None)
    return layer_types[layer_idx] if layer_types else "full_attention"


class Attention(nn.Module):
    """Grouped-query self-attention with optional q/k/v bias, per-head q/k RMSNorm and sliding window.

    The kernel comes from `ALL_ATTENTION_FUNCTIONS` by `config._attn_implementation` (eager is ours).
    While an `AttentionRecorder` is attached (`recording_attentions`), each run records the kernel's
    (B, H, L, S) weights.
    """

    attention_recorder: AttentionRecorder | None = None

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = getattr(config, "attention_dropout", 0.0)
        self.is_causal = True
        self.layer_type = layer_type_of(config, layer_idx)
        self.sliding_window = config.sliding_window if self.layer_type == "sliding_attention" else None
        qkv_bias = getattr(config, "attention_bias", False)
        output_bias = getattr(config, "attention_output_bias", False)
        width = config.hidden_size
        self.q_proj = nn.Linear(width, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(width, self.num_key_value_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(width, self.num_key_value_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, width, bias=output_bias)
        if getattr(config, "qk_norm", False):
            # Qwen3: RMSNorm over each head's K dims, before RoPE.
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def project(
        self,
        token_states: torch.Tensor,
        additions: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, L, D) -> query (B, H, L, K), key and value (B, G, L, K), before RoPE.

        `additions` are (B, L, H·K), (B, L, G·K), (B, L, G·K) terms added to the projections before the
        q/k norms (ConceptMoE's joint decoding adds projected concepts there).
        """
        head_shape = (*token_states.shape[:-1], -1, self.head_dim)
        query, key, value = self.q_proj(token_states), self.k_proj(token_states), self.v_proj(token_states)
        if additions is not None:
            query, key, value = query + additions[0], key + additions[1], value + additions[2]
        query, key, value = query.view(head_shape), key.view(head_shape), value.view(head_shape)
        if self.q_norm is not None:
            query, key = self.q_norm(query), self.k_norm(key)
        return query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        past_key_values=None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, L, D) token states -> (B, L, D) and the attention weights (eager only, else None)."""
        projected = self.project(hidden_states)
        return self.attend(projected, position_embeddings, attention_mask, past_key_values, **kwargs)

    def kernel(self) -> Callable:
        """The attention function of `config._attn_implementation` (HF's signature; eager is ours)."""
        return ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )

    def attend(
        self,
        projected: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        past_key_values=None,
        narrow: Callable[..., tuple[torch.Tensor, ...]] | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """RoPE, cache update, the configured kernel and o_proj over `project`'s query, key and value.

        `narrow`, when given, maps (query, key, value, mask) after the cache update (every new key and
        value is stored) to the rows the caller wants outputs for; Hidden Decoding's last layer keeps the
        final stream's queries only."""
        query, key, value = projected
        cos, sin = position_embeddings
        query, key = apply_rotary(query, key, cos, sin)
        if past_key_values is not None:
            # (B, G, S, K) with S = cached + new positions
            key, value = past_key_values.update(key, value, self.layer_idx)
        if narrow is not None:
            query, key, value, attention_mask = narrow(query, key, value, attention_mask)
        output, weights = self.kernel()(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            sliding_window=self.sliding_window,
            **kwargs,
        )
        if self.attention_recorder is not None:
            used = self.attention_recorder.record(self, weights)
            if used is not weights:
                # The recorder returned its entry's view of the weights (equal values): the output reads
                # them, so the returned attentions are part of the graph.
                value = repeat_kv(value, self.num_key_value_groups)
                output = torch.matmul(used, value).transpose(1, 2).contiguous()
        # (B, L, H·K)
        output = output.reshape(*output.shape[:2], -1).contiguous()
        return self.o_proj(output), weights


class MLP(nn.Module):
    """SwiGLU feed-forward: down(act(gate(x)) * up(x))."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu", bias: bool = False
    ):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = ACT2FN[hidden_act]

    def forward(self, token_states: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(token_states)) * self.up_proj(token_states))


def route_top_k(
    router_logits: torch.Tensor, top_k: int, normalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, E) logits -> fp32 (N, top_k) weights and (N, top_k) expert indices.

    Softmax over all experts in fp32, then top-k of the probabilities; `normalize` rescales the kept k
    to sum to 1 (Mixtral always, Qwen-MoE when `norm_topk_prob`).
    """
    probabilities = torch.softmax(router_logits.float(), dim=-1)
    weights, indices = torch.topk(probabilities, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, indices


class SparseMoeBlock(nn.Module):
    """Top-k mixture of SwiGLU experts (Mixtral, Qwen2-MoE, Qwen3-MoE), one `nn.Linear` per projection.

    Router `gate` (D -> E, no bias), `experts[e]` an `MLP` of width `moe_intermediate_size`, and, when
    `shared_expert_intermediate_size > 0`, a Qwen2-MoE shared expert scaled by sigmoid(`shared_expert_gate`).
    Returns the (B, L, D) output and the (N, E) router logits (for auxiliary losses).
    """

    def __init__(self, config) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = getattr(config, "norm_topk_prob", True)
        width, hidden_act = config.hidden_size, config.hidden_act
        self.gate = nn.Linear(width, self.num_experts, bias=False)
        self.experts = nn.ModuleList(
            MLP(width, config.moe_intermediate_size, hidden_act) for _ in range(self.num_experts)
        )
        shared_size = getattr(config, "shared_expert_intermediate_size", 0) or 0
        if shared_size > 0:
            self.shared_expert = MLP(width, shared_size, hidden_act)
            self.shared_expert_gate = nn.Linear(width, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # (N, D)
        flat_states = hidden_states.reshape(-1, hidden_states.shape[-1])
        # (N, E)
        router_logits = self.gate(flat_states)
        weights, indices = route_top_k(router_logits, self.top_k, self.norm_topk_prob)
        output = torch.zeros_like(flat_states)
        for expert_idx, expert in enumerate(self.experts):
            # Every expert runs (possibly on zero tokens) so all parameters stay in the graph.
            token_idx, slot_idx = torch.where(indices == expert_idx)
            expert_states = expert(flat_states[token_idx]) * weights[token_idx, slot_idx, None]
            output.index_add_(0, token_idx, expert_states.to(output.dtype))
        if self.shared_expert is not None:
            shared = self.shared_expert(flat_states)
            output = output + torch.sigmoid(self.shared_expert_gate(flat_states)) * shared
        return output.reshape(hidden_states.shape), router_logits


def uses_moe(config, layer_idx: int) -> bool:
    """Qwen-MoE placement rule: sparse unless listed in `mlp_only_layers` or off the `decoder_sparse_step`."""
    if (getattr(config, "num_experts", 0) or 0) <= 0:
        return False
    if layer_idx in (getattr(config, "mlp_only_layers", None) or ()):
        return False
    return (layer_idx + 1) % getattr(config, "decoder_sparse_step", 1) == 0


class DecoderLayer(GradientCheckpointingLayer):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)); the MLP is dense or sparse per layer.

    forward returns ((B, L, D) token states, (N, E) router logits or None for a dense layer).
    """

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.attention_type = layer_type_of(config, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if uses_moe(config, layer_idx):
            self.mlp = SparseMoeBlock(config)
        else:
            bias = getattr(config, "mlp_bias", False)
            self.mlp = MLP(config.hidden_size, config.intermediate_size, config.hidden_act, bias=bias)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The cache comes as `cache_kwarg(cache)` (gradient checkpointing drops it under that name)."""
        cache = layer_cache(kwargs)
        return self.attend_and_mix(
            hidden_states,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            past_key_values=cache,
            **kwargs,
        )

    def attend_and_mix(
        self, hidden_states: torch.Tensor, **attention_kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The pre-norm residual body: attention (its keyword arguments passed through), then the MLP."""
        return residual_body(self, hidden_states, **attention_kwargs)


def residual_body(
    layer: nn.Module,
    hidden_states: torch.Tensor,
    cross: Callable[[torch.Tensor], torch.Tensor] | None = None,
    **attention_kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The pre-norm residual body every decoder layer shares: x + self_attn(norm x), then (DLCM's and
    LSLM's decoders) x + cross(x), where `cross` applies its own norm, then x + mlp(norm x).

    `layer` has `input_layernorm`, `self_attn`, `post_attention_layernorm` and `mlp`. Returns the states
    and the router logits of a sparse MLP (None for a dense one).
    """
    attended, _ = layer.self_attn(layer.input_layernorm(hidden_states), **attention_kwargs)
    hidden_states = hidden_states + attended
    if cross is not None:
        hidden_states = hidden_states + cross(hidden_states)
    return mlp_residual(layer, hidden_states)


def mlp_residual(layer: nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x + mlp(norm x), the second half of `residual_body`, and the router logits of a sparse MLP (None
    for a dense one)."""
    mixed = layer.mlp(layer.post_attention_layernorm(hidden_states))
    router_logits = None
    if isinstance(mixed, tuple):
        mixed, router_logits = mixed
    return hidden_states + mixed, router_logits


@torch.no_grad()
def init_backbone_weights(module: nn.Module, std: float) -> None:
    """Initialise one leaf module of a backbone built from these blocks; every family's `_init_weights`
    uses it.

    One branch per leaf type: for remote code, transformers skips `_init_weights` on a module whose own
    parameters (not its children's) are all marked initialised, which a module with none of its own always
    is, so a parent writing into a child's weights would be skipped.
    """
    if isinstance(module, nn.Linear):
        init.normal_(module.weight, mean=0.0, std=std)
        if module.bias is not None:
            init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        init.normal_(module.weight, mean=0.0, std=std)
        if module.padding_idx is not None and not getattr(module.weight, "_is_hf_initialized", False):
            init.zeros_(module.weight[module.padding_idx])
    elif isinstance(module, RMSNorm):
        init.ones_(module.weight)
    elif isinstance(module, RotaryEmbedding):
        # Non-persistent buffer: never in a checkpoint, garbage after meta-device loading.
        inv_freq, module.attention_scaling = module.compute_inv_freq()
        init.copy_(module.inv_freq, inv_freq)
