"""Convert a Llama / Mistral / Qwen2 / Qwen3 / Mixtral / Qwen-MoE checkpoint into a Hidden Decoding
checkpoint, and grow a Hidden Decoding checkpoint's stream count (progressive expansion).

Conversion contract (`convert_to_hidden_decoding`):
- Every source tensor keeps its name. The embedding (V, D) becomes n tables side by side,
  `E.repeat(1, n)` of shape (V, n·D): stream k reads columns k·D:(k+1)·D, and all n start equal.
- `lm_head.weight` is always written: Hidden Decoding never ties its head (n tables cannot tie to one
  head), so a tied source gets a copy of its embedding as the head.
- Layout: one of "intra" / "local" / "full" per layer (`default_stream_layout`, Appendix H: one
  cross-stream layer in `cross_every`). A source with full-attention layers: its sliding-window layers
  become `local`, among the others every `cross_every`-th layer is `full`, the rest `intra`. A source
  whose layers all slide (Mistral 7B v0.1): every `cross_every`-th layer is `local`, the rest `intra`,
  and no layer is `full`. A layout can also be given as a pattern (see `parse_stream_layout`); a source
  layer with a sliding window can only become `local` (or `intra` when all source layers slide).
- Windows are in tokens: `local_window` (default: the source's window; the config derives
  `sliding_window` = local_window × n expanded positions, each token occupying n slots) and, for a source
  whose layers all slide, `intra_window` = the source's window. Each stream, and the final stream of a
  local layer, then sees the tokens the source layer saw.
- With n = 1 every layer kind computes the source's attention, so the converted model gives the source
  model's logits. At any n, the defaults `cross_stream_mask="token_block"` (every stream of token i sees
  all streams of tokens ≤ i in local and full layers, local windows in whole tokens) and token RoPE
  positions in every layer (`cross_stream_positions`, `intra_stream_positions`) keep them too: all n
  streams of every token then hold the source's state at every layer, so the step-0 model is the source
  (the argument is in `modeling_hidden_decoding`'s docstring; tests/test_hidden_decoding_lossless.py). The
  paper's form (`cross_stream_mask="causal"`, `cross_stream_positions="expanded"`) stays selectable; on
  SmolLM2-135M's held-out English text it costs +0.16 nats per token at n = 2 and +0.44 at n = 4 before
  any training, the default 0.0000 with max |Δlogit| 6e-5 (benchmarks/hidden_decoding_lossless.py).
- `intra_stream_positions` defaults to "token" here (one RoPE position per token, as the source was
  trained), while a from-scratch `HiddenDecodingConfig` keeps the paper's "expanded" (p·n + k). The
  expanded positions stretch every distance an intra layer sees by n, which a pretrained source never
  saw. Converted to n = 4 before any training, a Llama-style source with held-out loss 5.484 gave 5.62
  with expanded and 5.483 with token positions (measured under the paper's cross-stream
  form); the tiny source of tests/test_convert_hidden_decoding.py, 5.934, gives 5.965 (expanded) and
  5.934 (token) under the token-block default.

Expansion contract (`expand_hidden_decoding`): n → m streams with m a multiple of n, by cyclic
replication (paper eq. 5, E_{n+k} ← E_k): the tables become (E_1..E_n, E_1..E_n, ...); `sliding_window`
is scaled by m / n for the same reason as above; every other tensor and setting is copied, the
cross-stream mask and positions included unless given. With token-block masks and token positions the
grown model computes what the checkpoint computed, trained or not (`modeling_hidden_decoding`).

Both check every tensor's shape against a model built on the meta device, name missing and unused
tensors, and stream shard by shard into `writer.atomic_folder`, so any error leaves no destination.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from hf_concept.conversion.conceptmoe import resolve_dtype
from hf_concept.conversion.sources import (
    check_safetensors_files,
    iter_source_tensors,
    plain_config_from_source,
    plain_tensors,
    read_source_config,
)
from hf_concept.conversion.writer import (
    atomic_folder,
    check_destination,
    copy_side_files,
    parse_size,
    write_config_with_remote_code,
    write_tensors,
)
from hf_concept.model_card import card_license, write_model_card

logger = logging.getLogger(__name__)

HIDDEN_DECODING_TYPE = "hidden_decoding"
STREAM_LAYER_KINDS = ("intra", "local", "full")
# One letter per layer kind in compact layout patterns ("iiif*2").
LAYOUT_LETTERS = {"i": "intra", "l": "local", "f": "full"}
EMBEDDING = "model.embed_tokens.weight"
HEAD = "lm_head.weight"
# Keys of a saved config that describe the file, not the model; the new config sets its own.
_FILE_KEYS = ("model_type", "architectures", "auto_map", "transformers_version", "dtype", "torch_dtype")


def _model_classes():
    """(HiddenDecodingModel, HiddenDecodingForCausalLM), imported when needed: --help stays fast."""
    from hf_concept.modeling.modeling_hidden_decoding import HiddenDecodingForCausalLM, HiddenDecodingModel

    return HiddenDecodingModel, HiddenDecodingForCausalLM


def _check_positive_int(name: str, value: Any) -> int:
    if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        raise ValueError(f"{name}={value!r} must be a positive integer")
    return value


def _parse_layout_item(item: str, text: str) -> list[str]:
    """Kinds of one comma-separated item: a kind name or a run of letters, optionally `*TIMES`."""
    body, star, times = (part.strip() for part in item.partition("*"))
    if star and not (times.isdigit() and int(times) > 0):
        raise ValueError(f"stream_attention_layout={text!r}: {item!r} must repeat a positive number of times")
    body = body.lower()
    if body in STREAM_LAYER_KINDS:
        run = [body]
    elif body and all(letter in LAYOUT_LETTERS for letter in body):
        run = [LAYOUT_LETTERS[letter] for letter in body]
    else:
        raise ValueError(
            f"stream_attention_layout={text!r}: {item.strip()!r} is neither a layer kind "
            f"({', '.join(STREAM_LAYER_KINDS)}) nor a run of the letters i/l/f"
        )
    return run * (int(times) if star else 1)


def parse_stream_layout(layout: str | Sequence[str], num_hidden_layers: int) -> list[str]:
    """The per-layer kinds of `layout`: a list of kind names, or a pattern string.

    A pattern is comma-separated items; an item is a kind name (`intra`, `local`, `full`) or a run of
    letters (i = intra, l = local, f = full), optionally followed by `*TIMES`. So "intra,intra,intra,full",
    "iiif" and "intra*3,full" are the same 4-layer layout, and "iiif*2" is 8 layers. The result must have
    `num_hidden_layers` entries.
    """
    if isinstance(layout, str):
        kinds = [kind for item in layout.split(",") for kind in _parse_layout_item(item, layout)]
    elif isinstance(layout, Sequence) and all(kind in STREAM_LAYER_KINDS for kind in layout):
        kinds = list(layout)
    else:
        raise ValueError(
            f"stream_attention_layout={layout!r} must be a pattern string or a list of "
            f"{', '.join(STREAM_LAYER_KINDS)}"
        )
    if len(kinds) != num_hidden_layers:
        raise ValueError(
            f"stream_attention_layout={layout!r} gives {len(kinds)} layers; "
            f"the model has num_hidden_layers={num_hidden_layers}"
        )
    return kinds


def compact_layout(layout: Sequence[str]) -> str:
    """The letter form of a layout ("iiif"), as the model card prints it."""
    return "".join(kind[0] for kind in layout)


def _check_source_layers(
    layout: list[str], source_layer_types: list[str], source_window: int | None, every_layer_slides: bool
) -> None:
    """A sliding-window source layer may become `local`, or `intra` when every source layer slides (the
    intra layers then share the source's window); `full`, or `intra` beside full source layers, would see
    past the window the layer was trained with."""
    for index, (kind, source_kind) in enumerate(zip(layout, source_layer_types, strict=True)):
        if source_kind != "sliding_attention" or kind == "local" or (kind == "intra" and every_layer_slides):
            continue
        reason = "would see past" if kind == "full" else "cannot keep beside full-attention source layers"
        raise ValueError(
            f"stream_attention_layout={compact_layout(layout)!r}: layer {index} is {kind!r}, but source "
            f"layer {index} uses a sliding window of {source_window} tokens, which a {kind} layer {reason}; "
            "make it local"
        )


def _window_fields(
    layout: list[str],
    source_layer_types: list[str],
    source_window: int | None,
    local_window: Any,
    sliding_window: Any,
) -> dict[str, int]:
    """The converted config's windows: `local_window` (tokens; default the source's window) or the
    fine-grained `sliding_window` (expanded positions) for local layers, and `intra_window` = the source's
    window for the intra layers of a source whose layers all slide."""
    from hf_concept.modeling.configuration_hidden_decoding import all_sliding

    every_layer_slides = all_sliding(source_layer_types)
    _check_source_layers(layout, source_layer_types, source_window, every_layer_slides)
    fields = {}
    if "local" not in layout:
        for name, value in (("local_window", local_window), ("sliding_window", sliding_window)):
            if value is not None:
                raise ValueError(f"{name}={value!r} is unused: the layout has no local layer")
    elif local_window is not None and sliding_window is not None:
        raise ValueError(
            f"local_window={local_window!r} and sliding_window={sliding_window!r}: give one (local_window in "
            "tokens, or sliding_window in expanded positions)"
        )
    elif sliding_window is not None:
        fields["sliding_window"] = _check_positive_int("sliding_window", sliding_window)
    elif local_window is not None:
        fields["local_window"] = _check_positive_int("local_window", local_window)
    elif source_window is None:
        raise ValueError(
            f"stream_attention_layout={compact_layout(layout)!r} has local layers but the source has no "
            "sliding_window; pass local_window (tokens)"
        )
    else:
        fields["local_window"] = source_window
    if "intra" in layout and every_layer_slides:
        fields["intra_window"] = source_window
    return fields


def hidden_decoding_config_from_source(
    source_config,
    *,
    num_streams: int,
    stream_attention_layout: str | Sequence[str] | None,
    cross_every: int,
    intra_stream_positions: str,
    stream_kv: str,
    sliding_window: int | None,
    local_window: int | None = None,
    cross_stream_mask: str = "token_block",
    cross_stream_positions: str = "token",
):
    """A HiddenDecodingConfig with the source's backbone fields and the conversion options."""
    from hf_concept.modeling.configuration_hidden_decoding import HiddenDecodingConfig, default_stream_layout

    _check_positive_int("num_streams", num_streams)
    _check_positive_int("cross_every", cross_every)
    plain = plain_config_from_source(source_config)
    layers = plain.num_hidden_layers
    if stream_attention_layout is None:
        layout = default_stream_layout(layers, cross_every, plain.layer_types)
    else:
        layout = parse_stream_layout(stream_attention_layout, layers)
    windows = _window_fields(layout, plain.layer_types, plain.sliding_window, local_window, sliding_window)
    fields = plain.to_dict()
    # layer_types is derived from the layout; the head is never tied (n tables, one head).
    for key in (*_FILE_KEYS, "layer_types", "sliding_window", "tie_word_embeddings"):
        fields.pop(key, None)
    return HiddenDecodingConfig(
        **fields,
        **windows,
        num_streams=num_streams,
        stream_attention_layout=layout,
        intra_stream_positions=intra_stream_positions,
        cross_stream_mask=cross_stream_mask,
        cross_stream_positions=cross_stream_positions,
        stream_kv=stream_kv,
        tie_word_embeddings=False,
    )


def source_departures(config, source_layer_types: list[str], source_window: int | None) -> list[str]:
    """What keeps a converted `config` from giving its source's logits (module docstring): the paper's
    cross-stream form or expanded positions with several streams, and local layers whose window is
    shorter than what the source layer attends to. Empty when the conversion is exact."""
    layout, streams = config.stream_attention_layout, config.num_streams
    departures = []
    if streams > 1 and {"local", "full"} & set(layout):
        if config.cross_stream_mask != "token_block":
            departures.append(f"cross_stream_mask={config.cross_stream_mask!r}")
        if config.cross_stream_positions != "token":
            departures.append(f"cross_stream_positions={config.cross_stream_positions!r}")
    if streams > 1 and "intra" in layout and config.intra_stream_positions != "token":
        departures.append(f"intra_stream_positions={config.intra_stream_positions!r}")
    window = None if config.sliding_window is None else config.sliding_window // streams

    def source_span(index: int) -> float:
        # What the source layer attends to, in tokens: its window, or everything.
        sliding = source_layer_types[index] == "sliding_attention" and source_window is not None
        return source_window if sliding else float("inf")

    narrowed = [i for i, kind in enumerate(layout) if kind == "local" and window < source_span(i)]
    if narrowed:
        seen = sorted(
            {
                "the whole context" if source_span(i) == float("inf") else f"{source_span(i)} tokens"
                for i in narrowed
            }
        )
        departures.append(
            f"local layers {narrowed} see {window} tokens where the source layers see {' or '.join(seen)}"
        )
    return departures


def warn_if_lossy(config, source_config) -> None:
    """One notice when the converted model will not give its source's logits, saying what would."""
    plain = plain_config_from_source(source_config)
    departures = source_departures(config, plain.layer_types, plain.sliding_window)
    if departures:
        logger.warning(
            "this conversion does not keep the source's logits (%s); the defaults keep it exact: "
            "token_block cross-stream masks, token positions, local layers only where the source "
            "slides, with its window (--stream-kv shared is exact too)",
            "; ".join(departures),
        )


def expected_shapes(config) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor a checkpoint of `config` holds (the head included: never tied)."""
    _, HiddenDecodingForCausalLM = _model_classes()
    with torch.device("meta"):
        model = HiddenDecodingForCausalLM(config)
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def checked_tensors(
    src: Path, tensors: Iterable[tuple[str, torch.Tensor]], shapes: dict[str, tuple[int, ...]], dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass (name, tensor) pairs through in `dtype` after checking each against `shapes`; raise
    ValueError naming shape mismatches, duplicates, unused source tensors and missing tensors."""
    filled: set[str] = set()
    unused: list[str] = []
    for name, tensor in tensors:
        if name not in shapes:
            unused.append(name)
            continue
        if name in filled:
            raise ValueError(f"{src}: tensor {name!r} appears twice in the source")
        if tuple(tensor.shape) != shapes[name]:
            raise ValueError(
                f"{src}: shape mismatch for {name!r}: the source has {tuple(tensor.shape)}, "
                f"the Hidden Decoding config needs {shapes[name]} (does config.json match the weights?)"
            )
        filled.add(name)
        yield name, tensor.to(dtype)
    missing = sorted(set(shapes) - filled)
    if missing or unused:
        raise ValueError(
            f"{src}: tensors missing from the source: {missing}; unused source tensors: {unused}"
        )


def replicated_tensors(
    src: Path, model_type: str, num_streams: int, tied_source: bool, allow_pickle: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """(our name, tensor) for every source tensor, with the embedding replicated into `num_streams`
    tables; a tied source's head is written as a copy of its embedding (a stored copy is dropped)."""
    for key, tensor in iter_source_tensors(src, allow_pickle=allow_pickle):
        for name, value in plain_tensors(key, tensor, model_type):
            if tied_source and name == HEAD:
                continue
            if name == EMBEDDING:
                if tied_source:
                    yield HEAD, value
                # (V, D) -> (V, n·D): row v = [E(v) | E(v) | ... ], stream k at columns k·D:(k+1)·D.
                value = value.repeat(1, num_streams)
            yield name, value


def convert_to_hidden_decoding(
    src: str | Path,
    dst: str | Path,
    *,
    num_streams: int,
    stream_attention_layout: str | Sequence[str] | None = None,
    cross_every: int = 4,
    intra_stream_positions: str = "token",
    cross_stream_mask: str = "token_block",
    cross_stream_positions: str = "token",
    stream_kv: str = "per_stream",
    sliding_window: int | None = None,
    local_window: int | None = None,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = "2GB",
    overwrite: bool = False,
    allow_pickle: bool = False,
    base_model: str | None = None,
) -> Path:
    """Convert the source checkpoint folder `src` into a Hidden Decoding checkpoint folder `dst`
    with `num_streams` streams; returns `dst`.

    `stream_attention_layout` is a list of kinds or a pattern (`parse_stream_layout`); None derives it
    from the source (`default_stream_layout` with `cross_every`). `local_window` (tokens) defaults to the
    source's window; `sliding_window` (expanded positions) replaces it where needed. `dtype` defaults to
    the source's; `base_model` names the source in the model card (default: the `src` path). The
    defaults (token-block cross-stream masks, token positions everywhere) give the source's logits at any
    `num_streams`; `cross_stream_mask="causal"` with `cross_stream_positions="expanded"` is the paper's
    form. Raises
    ValueError, with `dst` left untouched, for an unsupported model_type, a bad option, missing/corrupt
    shards, NaN/inf weights, shape mismatches, `.bin` weights without `allow_pickle=True`, a `dst` that
    is, contains or lies inside `src` (even with `overwrite=True`), or an existing non-empty `dst` without
    `overwrite=True`.
    """
    src = Path(src)
    dst = check_destination(dst, overwrite, source=src)
    parse_size(max_shard_size)
    source_config = read_source_config(src)
    config = hidden_decoding_config_from_source(
        source_config,
        num_streams=num_streams,
        stream_attention_layout=stream_attention_layout,
        cross_every=cross_every,
        intra_stream_positions=intra_stream_positions,
        cross_stream_mask=cross_stream_mask,
        cross_stream_positions=cross_stream_positions,
        stream_kv=stream_kv,
        sliding_window=sliding_window,
        local_window=local_window,
    )
    dtype = resolve_dtype(dtype, source_config)
    check_safetensors_files(src)
    warn_if_lossy(config, source_config)
    shapes = expected_shapes(config)
    tied_source = bool(getattr(source_config, "tie_word_embeddings", False))
    source = replicated_tensors(src, source_config.model_type, num_streams, tied_source, allow_pickle)
    options = dict(dtype=dtype, max_shard_size=max_shard_size, overwrite=overwrite)
    options.update(base_model=base_model or str(src))
    options["settings"] = {"source_model_type": source_config.model_type}
    return _write(src, dst, config, checked_tensors(src, source, shapes, dtype), len(shapes), options)


def read_hidden_decoding_config(src: Path):
    """The HiddenDecodingConfig of an HD checkpoint folder, after checking its model_type."""
    from hf_concept.modeling.configuration_hidden_decoding import HiddenDecodingConfig

    path = src / "config.json"
    if not path.is_file():
        raise ValueError(f"folder={str(src)!r} has no config.json")
    model_type = json.loads(path.read_text()).get("model_type")
    if model_type != HIDDEN_DECODING_TYPE:
        raise ValueError(
            f"model_type={model_type!r} in {path}: expand needs a Hidden Decoding checkpoint "
            f"(model_type={HIDDEN_DECODING_TYPE!r}); convert a source with "
            "`hf-concept convert hidden-decoding` first"
        )
    return HiddenDecodingConfig.from_pretrained(str(src))


def expanded_config(config, num_streams: int, **settings: str | None):
    """`config` with `num_streams` streams (a multiple of the current count), the window scaled, and the
    given `settings` (`cross_stream_mask`, `cross_stream_positions`; None keeps the checkpoint's)."""
    from hf_concept.modeling.configuration_hidden_decoding import HiddenDecodingConfig

    _check_positive_int("num_streams", num_streams)
    current = config.num_streams
    if num_streams % current != 0:
        raise ValueError(
            f"num_streams={num_streams} must be a multiple of the checkpoint's num_streams={current} "
            "(cyclic replication copies whole groups of tables)"
        )
    factor = num_streams // current
    fields = config.to_dict()
    for key in (*_FILE_KEYS, "layer_types", "_name_or_path"):
        fields.pop(key, None)
    fields["num_streams"] = num_streams
    if fields.get("sliding_window") is not None:
        fields["sliding_window"] = fields["sliding_window"] * factor
    fields.update({name: value for name, value in settings.items() if value is not None})
    return HiddenDecodingConfig(**fields)


def cyclic_tables(embedding: torch.Tensor, num_streams: int, new_num_streams: int) -> torch.Tensor:
    """(V, n·D) tables (E_1..E_n) -> (V, m·D) tables (E_1..E_n, E_1..E_n, ...), eq. 5."""
    vocab, width = embedding.shape
    width //= num_streams
    tables = embedding.reshape(vocab, num_streams, width)  # (V, n, D)
    return tables.repeat(1, new_num_streams // num_streams, 1).reshape(vocab, new_num_streams * width)


def _expanded_tensors(src: Path, config, num_streams: int, allow_pickle: bool):
    """The HD checkpoint's tensors with the embedding grown to `num_streams` tables."""
    expected = (config.vocab_size, config.num_streams * config.hidden_size)
    for name, tensor in iter_source_tensors(src, allow_pickle=allow_pickle):
        if name == EMBEDDING:
            if tuple(tensor.shape) != expected:
                raise ValueError(
                    f"{src}: shape mismatch for {name!r}: the checkpoint has {tuple(tensor.shape)}, "
                    f"its config (num_streams={config.num_streams}) needs {expected}"
                )
            tensor = cyclic_tables(tensor, config.num_streams, num_streams)
        yield name, tensor


def expand_hidden_decoding(
    src: str | Path,
    dst: str | Path,
    *,
    num_streams: int,
    cross_stream_mask: str | None = None,
    cross_stream_positions: str | None = None,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = "2GB",
    overwrite: bool = False,
    allow_pickle: bool = False,
    base_model: str | None = None,
) -> Path:
    """Grow the Hidden Decoding checkpoint `src` to `num_streams` streams (a multiple of its own count)
    by cyclic replication of the embedding tables, writing `dst`; returns `dst`.

    `sliding_window` is scaled by the growth factor; every other tensor and setting is copied, the
    cross-stream mask and positions too unless `cross_stream_mask` / `cross_stream_positions` are given
    (a checkpoint converted with the defaults has token-block masks and token positions, under which the
    grown model computes what `src` computes; changing them changes what a trained model computes). `dtype`
    defaults to the checkpoint's. Raises ValueError, with `dst` left untouched, for a folder that is not
    a Hidden Decoding checkpoint, a `num_streams` that is not a multiple, missing/corrupt shards, NaN/inf
    weights, a `dst` that is, contains or lies inside `src`, or an existing non-empty `dst` without
    `overwrite=True`.
    """
    src = Path(src)
    dst = check_destination(dst, overwrite, source=src)
    parse_size(max_shard_size)
    old_config = read_hidden_decoding_config(src)
    config = expanded_config(
        old_config,
        num_streams,
        cross_stream_mask=cross_stream_mask,
        cross_stream_positions=cross_stream_positions,
    )
    dtype = resolve_dtype(dtype, old_config)
    check_safetensors_files(src)
    shapes = expected_shapes(config)
    source = _expanded_tensors(src, old_config, num_streams, allow_pickle)
    options = dict(dtype=dtype, max_shard_size=max_shard_size, overwrite=overwrite)
    options.update(base_model=base_model or str(src))
    options["settings"] = {"expanded_from_num_streams": old_config.num_streams}
    return _write(src, dst, config, checked_tensors(src, source, shapes, dtype), len(shapes), options)


def _write(src: Path, dst: Path, config, tensors: Iterator, total: int, options: dict[str, Any]) -> Path:
    """Shards, config with remote code, side files and model card, into `dst` atomically.

    `options`: dtype, max_shard_size, overwrite, base_model and the card's `settings`."""
    HiddenDecodingModel, HiddenDecodingForCausalLM = _model_classes()
    with atomic_folder(dst, overwrite=options["overwrite"], source=src) as folder:
        write_tensors(folder, tensors, options["max_shard_size"], total=total, description="convert")
        config.dtype = options["dtype"]
        config.architectures = [HiddenDecodingForCausalLM.__name__]
        model_classes = {"AutoModel": HiddenDecodingModel, "AutoModelForCausalLM": HiddenDecodingForCausalLM}
        write_config_with_remote_code(folder, config, model_classes)
        copy_side_files(src, folder)
        # The source's own card may state its licence; the converted weights inherit it.
        write_model_card(
            folder,
            base_model=options["base_model"],
            license=card_license(src),
            settings=options["settings"],
            name_or_path=str(dst),
        )
    return dst
