"""Configuration of the Hidden Decoding family (model_type "hidden_decoding").

Every backbone field is the plain family's (same names, same meaning, same checks). The Hidden Decoding
fields (HD paper §2; docs/ARCHITECTURE.md, §3.3):
- `num_streams` (n): each token enters the backbone as n streams with their own embedding tables.
- `stream_attention_layout`: per layer, "intra" (each stream attends to its own stream only), "local"
  (causal sliding window over the interleaved sequence, `local_window` tokens wide) or "full" (causal over
  all n·L expanded positions). `layer_types` is derived from it ("sliding_attention" for local layers),
  so the shared attention code picks the window up unchanged.
- `local_window` (tokens): how many tokens a local layer sees, the current one included: the final
  stream of token i sees every stream of tokens i - local_window + 1 … i. The shared attention and mask
  code read `sliding_window`, which counts expanded positions (n per token); it is derived here as
  local_window × n. Setting `sliding_window` alone (a window in expanded positions, need not be a
  multiple of n) is the fine-grained form; setting both requires them to agree.
- `intra_window` (tokens; None = unbounded, the paper's): how many tokens of its own stream an intra
  layer sees, the current one included. Converting a source whose layers all use a sliding window sets it
  to the source's window, so that each stream sees what the source layer saw (and n = 1 stays the
  source at any length).
- `intra_stream_positions`: RoPE positions inside intra layers, "expanded" (p·n + k, the paper; the
  default here, for models trained from scratch) or "token" (p, one position per token; the conversion
  default, since a pretrained source knows only token distances: converting a source with held-out loss
  5.484 to n = 4 gave 5.62 with expanded positions and 5.483 with token positions).
- `cross_stream_mask`: which keys a query sees in "local" and "full" layers. "causal" (the paper's Fig. 3:
  plain causal attention over the interleaved sequence, so stream k of token i sees the streams ≤ k of
  token i; the default, and what a saved config without the field loads as) or "token_block" (every
  stream of token i sees all n streams of the tokens ≤ i, and a local layer's window is the last
  `local_window` whole tokens; the conversion default). Seeing the later streams of one's own token is
  no leak: every stream of token i depends on tokens ≤ i only, and the loss at token i predicts i + 1.
- `cross_stream_positions`: RoPE positions in "local" and "full" layers, "expanded" (p·n + k, the
  paper's; the default) or "token" (p; the conversion default).
  With `cross_stream_mask="token_block"`, `cross_stream_positions="token"` and `intra_stream_positions=
  "token"`, conversion loses nothing at any n (`modeling_hidden_decoding`'s docstring has the argument).
- `stream_kv`: "per_stream" (each stream keeps its own keys and values in intra layers) or "shared"
  (the §5.2 ablation: intra layers keep only the final stream's keys and values as context).
- `stream_supervision` (the §5.1 / Table 5 objectives, all through the one shared final norm and LM head):
  "final" (the paper's HD, eq. 2: the next-token loss and the logits come from each token's final
  stream only; the default, and what a saved config without the field loads as), "all_streams" (the
  "all-token loss" ablation: every stream of token i predicts token i + 1; the loss is the mean over the
  n streams of each stream's usual per-label-token cross-entropy; the logits, and so generation, still
  come from the final stream) or "sum" (the "sum" ablation, "summing their outputs before prediction":
  the n streams' last-layer states are added *before* the final norm, and norm(sum) feeds the LM head
  for the loss, the logits and generation alike).

`check_fields` raises `ValueError` naming the field and the value.
"""

from __future__ import annotations

from typing import Any, ClassVar

from .configuration_plain import MAX_COUNT, MAX_SIZE, PlainDecoderConfig, _is_int
from .transformers_compat import CACHE_KEYS

STREAM_ATTENTION_KINDS = ("intra", "local", "full")
INTRA_STREAM_POSITIONS = ("expanded", "token")
STREAM_POSITION_KINDS = INTRA_STREAM_POSITIONS
CROSS_STREAM_MASKS = ("causal", "token_block")
STREAM_KV_KINDS = ("per_stream", "shared")
STREAM_SUPERVISION_KINDS = ("final", "all_streams", "sum")
# The paper's default density of cross-stream layers (Appendix H: one cross-stream layer in four).
DEFAULT_CROSS_EVERY = 4


def all_sliding(source_layer_types: list[str] | None) -> bool:
    """Whether every layer of a source uses a sliding window (Mistral 7B v0.1, windowed Mixtral)."""
    return bool(source_layer_types) and all(kind == "sliding_attention" for kind in source_layer_types)


def default_stream_layout(
    num_hidden_layers: int,
    cross_every: int = DEFAULT_CROSS_EVERY,
    source_layer_types: list[str] | None = None,
) -> list[str]:
    """Per-layer stream attention (SFA, HD §2.2 and Appendix H), one cross-stream layer in `cross_every`:
    - a source with full-attention layers (all or some): its sliding-window layers become "local" (HD
      §2.2 reuses them as the cross-stream layers); among the others, layer i is "full" when
      i % cross_every == cross_every - 1 and "intra" otherwise;
    - a source whose layers all use a sliding window: layer i is "local" when i % cross_every ==
      cross_every - 1 and "intra" otherwise (no layer may see past the source's window, so there are
      no full layers; conversion gives the intra layers the source's window as `intra_window`).
    cross_every=1 makes every layer cross-stream."""
    if not (_is_int(cross_every) and cross_every >= 1):
        raise ValueError(f"cross_every={cross_every!r} must be a positive integer")
    if source_layer_types is not None and len(source_layer_types) != num_hidden_layers:
        raise ValueError(
            f"source_layer_types has {len(source_layer_types)} entries, expected {num_hidden_layers}"
        )
    cross = "local" if all_sliding(source_layer_types) else "full"
    layout = []
    for index in range(num_hidden_layers):
        if cross == "local":
            layout.append("local" if index % cross_every == cross_every - 1 else "intra")
        elif source_layer_types is not None and source_layer_types[index] == "sliding_attention":
            layout.append("local")
        else:
            layout.append("full" if index % cross_every == cross_every - 1 else "intra")
    return layout


def layer_types_of_layout(layout: list[str]) -> list[str]:
    return ["sliding_attention" if kind == "local" else "full_attention" for kind in layout]


class HiddenDecodingConfig(PlainDecoderConfig):
    """Config of `HiddenDecodingForCausalLM`: a plain backbone run over n interleaved streams per token.

    A "local" layer needs its window: `local_window` in tokens (or `sliding_window` in expanded positions,
    n per token; the one is derived from the other, see the module docstring).
    """

    model_type = "hidden_decoding"
    keys_to_ignore_at_inference: ClassVar[list[str]] = [*CACHE_KEYS, "hidden_states", "stream_states"]

    num_streams: int = 2
    stream_attention_layout: list[str] | None = None
    intra_stream_positions: str = "expanded"
    cross_stream_mask: str = "causal"
    cross_stream_positions: str = "expanded"
    stream_kv: str = "per_stream"
    stream_supervision: str = "final"
    local_window: int | None = None
    intra_window: int | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        if isinstance(self.stream_attention_layout, tuple):
            self.stream_attention_layout = list(self.stream_attention_layout)
        layers = self.num_hidden_layers
        # A layer count out of range is left for check_fields to name, not turned into a huge layout.
        if self.stream_attention_layout is None and _is_int(layers) and 0 < layers <= MAX_COUNT:
            self.stream_attention_layout = default_stream_layout(layers)
        self._derive_sliding_window()
        layout = self.stream_attention_layout
        if isinstance(layout, list) and all(kind in STREAM_ATTENTION_KINDS for kind in layout):
            derived = layer_types_of_layout(layout)
            if self.layer_types is not None and list(self.layer_types) != derived:
                raise ValueError(
                    f"layer_types={self.layer_types!r} conflicts with stream_attention_layout={layout!r}; "
                    "leave layer_types unset, it follows the layout"
                )
            self.layer_types = derived
        # The parent merges this with any saved auto_map and keeps our AutoModel entry.
        auto_map = {"AutoModel": "modeling_hidden_decoding.HiddenDecodingModel"}
        auto_map.update(kwargs.pop("auto_map", None) or {})
        kwargs["auto_map"] = auto_map
        super().__post_init__(**kwargs)

    def _derive_sliding_window(self) -> None:
        """sliding_window (expanded positions) = local_window (tokens) × num_streams; a conflict is named."""
        window, streams = self.local_window, self.num_streams
        if window is None or not (_is_int(window) and _is_int(streams) and window > 0 and streams > 0):
            return  # nothing to derive, or check_fields names the bad value
        derived = window * streams
        if self.sliding_window is not None and self.sliding_window != derived:
            raise ValueError(
                f"sliding_window={self.sliding_window!r} conflicts with local_window={window} tokens × "
                f"num_streams={streams} = {derived} expanded positions; set local_window only"
            )
        self.sliding_window = derived

    def check_fields(self) -> None:
        """Raise ValueError naming the first invalid field and its value."""
        # The layout is checked against num_hidden_layers and max_position_embeddings: those come first.
        self._check_sizes()
        streams, positions = self.num_streams, self.max_position_embeddings
        # Expanded sequences are num_streams times longer; their positions stay within MAX_SIZE too.
        most = min(MAX_COUNT, MAX_SIZE // positions)
        if not (_is_int(streams) and 1 <= streams <= most):
            raise ValueError(
                f"num_streams={streams!r} must be an integer in [1, {most}] (at most {MAX_COUNT} streams, "
                f"and num_streams × max_position_embeddings={positions} at most {MAX_SIZE} positions)"
            )
        layout = self.stream_attention_layout
        if not isinstance(layout, list) or len(layout) != self.num_hidden_layers:
            raise ValueError(
                f"stream_attention_layout={layout!r} must list one of {STREAM_ATTENTION_KINDS} for each of "
                f"num_hidden_layers={self.num_hidden_layers} layers"
            )
        unknown = sorted({str(kind) for kind in layout if kind not in STREAM_ATTENTION_KINDS})
        if unknown:
            raise ValueError(
                f"stream_attention_layout={layout!r} has {unknown}; allowed: {STREAM_ATTENTION_KINDS}"
            )
        for name in ("local_window", "intra_window"):
            value = getattr(self, name)
            if value is not None and not (_is_int(value) and 1 <= value <= MAX_SIZE):
                raise ValueError(f"{name}={value!r} must be None or an integer in [1, {MAX_SIZE}] (tokens)")
        if "local" in layout and self.sliding_window is None:
            raise ValueError(
                f"local_window=None and sliding_window=None but stream_attention_layout={layout!r} has local "
                "layers; set local_window (tokens)"
            )
        if self.intra_window is not None and self.stream_kv == "shared":
            raise ValueError(
                f"intra_window={self.intra_window} cannot hold with stream_kv='shared' (the shared-KV "
                "ablation has no windowed form); leave intra_window=None"
            )
        for name in ("intra_stream_positions", "cross_stream_positions"):
            if getattr(self, name) not in STREAM_POSITION_KINDS:
                raise ValueError(f"{name}={getattr(self, name)!r} must be one of {STREAM_POSITION_KINDS}")
        self._check_cross_stream_mask()
        if self.stream_kv not in STREAM_KV_KINDS:
            raise ValueError(f"stream_kv={self.stream_kv!r} must be one of {STREAM_KV_KINDS}")
        if self.stream_supervision not in STREAM_SUPERVISION_KINDS:
            raise ValueError(
                f"stream_supervision={self.stream_supervision!r} must be one of {STREAM_SUPERVISION_KINDS}"
            )
        if self.tie_word_embeddings and streams > 1:
            raise ValueError(
                f"tie_word_embeddings=True cannot hold with num_streams={streams}: the n embedding tables "
                "share one LM head that is tied to none of them"
            )
        super().check_fields()

    def _check_cross_stream_mask(self) -> None:
        mask, window, streams = self.cross_stream_mask, self.sliding_window, self.num_streams
        if mask not in CROSS_STREAM_MASKS:
            raise ValueError(f"cross_stream_mask={mask!r} must be one of {CROSS_STREAM_MASKS}")
        local = "local" in self.stream_attention_layout and _is_int(window)
        if mask == "token_block" and local and window % streams:
            raise ValueError(
                f"sliding_window={window} is not a whole number of tokens of num_streams={streams} "
                "positions: cross_stream_mask='token_block' windows whole tokens; set local_window (tokens)"
            )

    @property
    def local_window_tokens(self) -> int | None:
        """The local layers' window in whole tokens (token-block masks); None without local layers."""
        if "local" not in self.stream_attention_layout or self.sliding_window is None:
            return None
        return self.sliding_window // self.num_streams

    @property
    def stream_layer_kinds(self) -> set[str]:
        return set(self.stream_attention_layout)


HiddenDecodingConfig.register_for_auto_class()
