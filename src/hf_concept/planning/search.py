"""DLCM shapes whose inference FLOPs per token match a baseline's at a compression ratio and a concept
share."""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .costs import inference_flops_per_token, parameter_count, parameter_groups
from .specs import BaselineSpec, DLCMSpec, _is_int

# ---- search ----


@dataclass(frozen=True)
class Candidate:
    """A DLCM found by `search_dlcm`; `flops_error` = its matched FLOPs / the baseline's − 1."""

    spec: DLCMSpec
    flops_error: float
    concept_share: float


def _nearest_divisor(count: int, target: float) -> int:
    """The divisor of `count` nearest to `target` (the smaller one on a tie): KV heads for a GQA group."""
    divisors = [value for value in range(1, count + 1) if count % value == 0]
    return min(divisors, key=lambda value: (abs(value - target), value))


def _scaled_width(size: int, base_width: int, width: int) -> int:
    """`size` scaled by width / base_width, rounded to a multiple of 64 (at least 64)."""
    return max(64, round(size * width / base_width / 64) * 64)


def dlcm_like(
    baseline: BaselineSpec,
    token_width: int,
    concept_width: int,
    layers: tuple[int, int, int],
    compression_ratio: float,
) -> DLCMSpec:
    """A DLCM at the given widths and (encoder, concept, decoder) layers, otherwise shaped like `baseline`:
    its head dim everywhere, heads in proportion to width, its GQA group, MLP widths in its ratio to width,
    cross-attention with the token heads, untied or tied as the baseline."""
    head_dim = baseline.head_dim
    group = baseline.num_attention_heads / baseline.num_key_value_heads
    heads = max(1, round(baseline.num_attention_heads * token_width / baseline.hidden_size))
    concept_heads = max(1, round(baseline.num_attention_heads * concept_width / baseline.hidden_size))
    kv_heads = _nearest_divisor(heads, heads / group)
    base_mlp, base_width = baseline.intermediate_size, baseline.hidden_size
    return DLCMSpec(
        vocab_size=baseline.vocab_size,
        hidden_size=token_width,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=_scaled_width(base_mlp, base_width, token_width),
        encoder_layers=layers[0],
        concept_layers=layers[1],
        decoder_layers=layers[2],
        concept_hidden_size=concept_width,
        concept_num_attention_heads=concept_heads,
        concept_num_key_value_heads=_nearest_divisor(concept_heads, concept_heads / group),
        concept_head_dim=head_dim,
        concept_intermediate_size=_scaled_width(base_mlp, base_width, concept_width),
        cross_num_attention_heads=heads,
        cross_num_key_value_heads=kv_heads,
        cross_head_dim=head_dim,
        compression_ratio=compression_ratio,
        tie_word_embeddings=baseline.tie_word_embeddings,
        attention_bias=baseline.attention_bias,
        attention_output_bias=baseline.attention_output_bias,
        mlp_bias=baseline.mlp_bias,
        qk_norm=baseline.qk_norm,
    )


@dataclass(frozen=True)
class _LinearCosts:
    """A figure as base + Σ count × per-layer for (encoder, concept, decoder) layer counts: every figure
    here is linear in the layer counts, the other fields fixed."""

    base: float
    per_layer: tuple[float, float, float]

    def at(self, layers: tuple[int, int, int]) -> float:
        return self.base + sum(count * cost for count, cost in zip(layers, self.per_layer, strict=True))


def _linear_costs(measure: Any, build: Any) -> _LinearCosts:
    """Fit base and per-layer costs of `measure(build(layers))` from four layer splits."""
    ones = measure(build((1, 1, 1)))
    steps = [
        measure(build(tuple(2 if axis == index else 1 for axis in range(3)))) - ones for index in range(3)
    ]
    return _LinearCosts(ones - sum(steps), (steps[0], steps[1], steps[2]))


def _width_pair_matches(
    build: Any, target: float, measure: Any, bounds: tuple[float, float, float, int, int]
) -> list[tuple[float, float, tuple[int, int, int]]]:
    """(flops error, share, layers) of every layer split at one width pair within the tolerances; the
    concept layer count is solved for (FLOPs are linear in it), rounded both ways and kept in the grid."""
    low, high, tolerance, max_token_layers, max_concept_layers = bounds
    flops = _linear_costs(measure, build)
    total = _linear_costs(parameter_count, build)
    concept = _linear_costs(lambda spec: parameter_groups(spec)["model.concept_layers"], build)
    concept_norm = build((1, 1, 1)).concept_hidden_size
    found = []
    for encoders in range(1, max_token_layers + 1):
        for decoders in range(1, max_token_layers + 1):
            rest = flops.at((encoders, 0, decoders))
            ideal = (target - rest) / flops.per_layer[1]
            # The nearest counts inside the grid: FLOPs are monotone in the count, so clamping is exact.
            nearest = {min(max(rounded(ideal), 1), max_concept_layers) for rounded in (math.floor, math.ceil)}
            for concepts in nearest:
                layers = (encoders, concepts, decoders)
                error = flops.at(layers) / target - 1
                share = (concept.at(layers) + concept_norm) / total.at(layers)
                if abs(error) <= tolerance and low <= share <= high:
                    found.append((error, share, layers))
    return found


@dataclass(frozen=True)
class _SearchGrid:
    """The shapes `search_dlcm` tries: every (token width, concept width) pair and the layer-count bounds."""

    token_widths: Sequence[int]
    concept_widths: Sequence[int] | None
    step: int
    hidden_size: int
    max_token_layers: int
    max_concept_layers: int

    def width_pairs(self) -> Iterator[tuple[int, int]]:
        for token_width in self.token_widths:
            widths = self.concept_widths or range(token_width, 4 * self.hidden_size + 1, self.step)
            for concept_width in widths:
                _check_positive_ints_named({"token width": token_width, "concept width": concept_width})
                yield token_width, concept_width


def _search_grid(
    baseline: BaselineSpec,
    token_widths: Sequence[int] | None,
    concept_widths: Sequence[int] | None,
    max_token_layers: int | None,
    max_concept_layers: int | None,
) -> _SearchGrid:
    """The grid `search_dlcm` searches, its defaults (see its docstring) filled in from `baseline`."""
    step = max(baseline.head_dim, min(128, baseline.hidden_size // 8))
    hidden, depth = baseline.hidden_size, baseline.num_hidden_layers
    grid = _SearchGrid(
        token_widths=token_widths or range(max(step, (hidden // 2) // step * step), hidden + 1, step),
        concept_widths=concept_widths,
        step=step,
        hidden_size=hidden,
        max_token_layers=max_token_layers or max(1, depth // 2),
        max_concept_layers=max_concept_layers or 2 * depth,
    )
    _check_positive_ints_named(
        {"max_token_layers": grid.max_token_layers, "max_concept_layers": grid.max_concept_layers}
    )
    return grid


# (FLOPs rank, share rank, token width, concept width, layers, FLOPs error, share): smallest is best.
_RankedMatch = tuple[int, float, int, int, tuple[int, int, int], float, float]


def _ranked_matches(
    baseline: BaselineSpec,
    compression_ratio: float,
    grid: _SearchGrid,
    measure: Callable[[DLCMSpec | BaselineSpec], float],
    share_range: tuple[float, float],
    flops_tolerance: float,
) -> list[_RankedMatch]:
    """Every match in `grid`, ranked by its FLOPs error, then by its share's distance to the middle of
    `share_range`."""
    low, high = share_range
    target, middle = measure(baseline), (low + high) / 2
    # FLOPs errors within a tenth of the tolerance rank as equal, so that P decides between them.
    bucket = flops_tolerance / 10 or 1e-12
    bounds = (low, high, flops_tolerance, grid.max_token_layers, grid.max_concept_layers)
    ranked: list[_RankedMatch] = []
    for token_width, concept_width in grid.width_pairs():

        def build(
            layers: tuple[int, int, int], pair: tuple[int, int] = (token_width, concept_width)
        ) -> DLCMSpec:
            return dlcm_like(baseline, pair[0], pair[1], layers, compression_ratio)

        for error, share, layers in _width_pair_matches(build, target, measure, bounds):
            rank = (math.floor(abs(error) / bucket), abs(share - middle))
            ranked.append((*rank, token_width, concept_width, layers, error, share))
    return ranked


def search_dlcm(
    baseline: BaselineSpec,
    compression_ratio: float,
    target_share: float | tuple[float, float],
    *,
    share_tolerance: float = 0.05,
    context_length: int = 4096,
    flops_tolerance: float = 0.05,
    include_attention: bool = True,
    token_widths: Sequence[int] | None = None,
    concept_widths: Sequence[int] | None = None,
    max_token_layers: int | None = None,
    max_concept_layers: int | None = None,
    top_k: int = 10,
) -> list[Candidate]:
    """DLCMs shaped by `dlcm_like` whose inference FLOPs per token (attention map at `context_length`
    included or not) are within `flops_tolerance` of the baseline's and whose concept share P lies in
    `target_share` (a (low, high) range, or a value ± `share_tolerance`); best first: closest FLOPs (in
    steps of a tenth of the tolerance), then P closest to the middle of the range.

    Grids (defaults): token widths from hidden_size/2 to hidden_size in steps of 128 (head_dim if larger,
    hidden_size/8 if smaller); concept widths from the token width to 4 × hidden_size in the same steps;
    encoder and decoder layers from 1 to num_hidden_layers/2 each; concept layers from 1 to
    2 × num_hidden_layers.
    """
    share_range = _share_range(target_share, share_tolerance)
    _check_search_numbers(compression_ratio, flops_tolerance, top_k)
    grid = _search_grid(baseline, token_widths, concept_widths, max_token_layers, max_concept_layers)

    def measure(spec: DLCMSpec | BaselineSpec) -> float:
        return inference_flops_per_token(spec, context_length, include_attention=include_attention)

    ranked = _ranked_matches(baseline, compression_ratio, grid, measure, share_range, flops_tolerance)
    best = heapq.nsmallest(top_k, ranked)
    return [
        Candidate(dlcm_like(baseline, item[2], item[3], item[4], compression_ratio), item[5], item[6])
        for item in best
    ]


def _share_range(target_share: float | tuple[float, float], tolerance: float) -> tuple[float, float]:
    if isinstance(target_share, tuple):
        low, high = target_share
    else:
        low, high = target_share - tolerance, target_share + tolerance
    if not (0 <= low <= high <= 1 and high > 0):
        raise ValueError(f"target_share={target_share!r} must be in (0, 1) (a value or a low <= high range)")
    return low, high


def _check_search_numbers(compression_ratio: float, flops_tolerance: float, top_k: int) -> None:
    if not (isinstance(compression_ratio, int | float) and compression_ratio > 1):
        raise ValueError(f"compression_ratio={compression_ratio!r} must be a number > 1")
    if not (isinstance(flops_tolerance, int | float) and flops_tolerance >= 0):
        raise ValueError(f"flops_tolerance={flops_tolerance!r} must be a non-negative number")
    if not (_is_int(top_k) and top_k > 0):
        raise ValueError(f"top_k={top_k!r} must be a positive integer")


def _check_positive_ints_named(values: Mapping[str, Any]) -> None:
    for name, value in values.items():
        if not (_is_int(value) and value > 0):
            raise ValueError(f"{name}={value!r} must be a positive integer")
