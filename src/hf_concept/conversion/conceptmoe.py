"""Convert a Llama / Mistral / Qwen2 / Qwen3 / Mixtral / Qwen-MoE checkpoint into a ConceptMoE checkpoint.

Contract:
- The source's layers are split in order: the first `encoder_layers` become `model.encoder_layers.*`,
  the last `decoder_layers` become `model.decoder_layers.*`, the rest (at least one) become
  `model.concept_layers.*`; every other source tensor keeps its name. Each layer keeps its source
  index for `layer_types`, so sliding windows stay where they were.
- New tensors: the chunk module (`model.chunker.*`, random N(0, initializer_range) from a generator
  seeded with `seed`, or the identity for `router_init="identity"`) and the joint-decoding projectors
  (`self_attn.concept_{q,k,v}_proj`, zeros, reading the concept through `self_attn.concept_norm`, ones).
  `dechunk_residual` is always "delta", so with
  `chunking="fixed"`, `compression_ratio=1`, `pooling="first"` the converted model computes the
  source model's logits.
- Every tensor's shape is checked against a ConceptMoE model built on the meta device; missing and
  unused keys are reported by name. Tensors stream shard by shard into `writer.atomic_folder`, so any
  error leaves no destination folder behind.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from hf_concept.conversion.sources import (
    MOE_SOURCE_TYPES,
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

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SOURCE_LAYER = re.compile(r"^model\.layers\.(?P<index>\d+)\.(?P<rest>.+)$")
_JOINT_PROJECTOR = re.compile(r"\.self_attn\.concept_[qkv]_proj\.weight$")
_JOINT_NORM = re.compile(r"\.self_attn\.concept_norm\.weight$")
# Learned boundaries decide on each probability's rank among the last 64 tokens of its document: long
# enough that a text of a few sentences gets one concept per R tokens, short enough that a prompt does.
DEFAULT_RANK_WINDOW = 64


def _model_classes():
    """(ConceptMoEModel, ConceptMoEForCausalLM), imported when needed: the CLI's --help stays fast."""
    from hf_concept.modeling.modeling_conceptmoe import ConceptMoEForCausalLM, ConceptMoEModel

    return ConceptMoEModel, ConceptMoEForCausalLM


def resolve_dtype(dtype: str | torch.dtype | None, source_config) -> torch.dtype:
    """The output dtype: `dtype` by name or value, else the source's dtype, else float32."""
    if dtype is None:
        source_dtype = getattr(source_config, "dtype", None)
        if isinstance(source_dtype, str):
            source_dtype = DTYPES.get(source_dtype)
        return source_dtype if source_dtype in DTYPES.values() else torch.float32
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype={dtype!r} must be one of {', '.join(DTYPES)}")


def _check_layer_split(encoder_layers: Any, decoder_layers: Any, total: int) -> None:
    for name, value in (("encoder_layers", encoder_layers), ("decoder_layers", decoder_layers)):
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            raise ValueError(f"{name}={value!r} must be a non-negative integer")
    if encoder_layers + decoder_layers >= total:
        raise ValueError(
            f"encoder_layers={encoder_layers} + decoder_layers={decoder_layers} leave no concept layer: "
            f"the source has num_hidden_layers={total}; at least one layer must remain for the concept model"
        )


def conceptmoe_config_from_source(source_config, **options: Any):
    """A ConceptMoEConfig with the source's backbone fields and the conversion `options`
    (encoder_layers, decoder_layers, compression_ratio, chunking, joint_decoding_layers, concept_loop,
    experts_per_token, router, router_init, pooling, rank_window; other config fields, such as
    boundary_fixed_bonus, pass through)."""
    from hf_concept.modeling.configuration_conceptmoe import ConceptMoEConfig

    plain = plain_config_from_source(source_config)
    _check_layer_split(options["encoder_layers"], options["decoder_layers"], plain.num_hidden_layers)
    fields = plain.to_dict()
    for key in ("model_type", "architectures", "auto_map", "transformers_version", "dtype", "torch_dtype"):
        fields.pop(key, None)
    experts_per_token = options.pop("experts_per_token")
    if experts_per_token is not None:
        if source_config.model_type not in MOE_SOURCE_TYPES:
            raise ValueError(
                f"experts_per_token={experts_per_token!r} needs a MoE source; "
                f"model_type={source_config.model_type!r} is dense"
            )
        # §3.5 Strategy 1: the compute saved by chunking goes to the concept layers only; the encoder and
        # decoder keep the source's top-k.
        fields["concept_num_experts_per_tok"] = experts_per_token
    loop = options.pop("concept_loop")
    window = options.pop("rank_window", None)
    if window:
        # A window longer than the longest sequence ranks within the whole sequence: the same decisions.
        window = min(window, fields["max_position_embeddings"])
    fields.update(rank_window_fields(window, options["chunking"], options["compression_ratio"]))
    if options["router_init"] == "identity" and options["router"] != "cosine":
        raise ValueError(f"router_init='identity' needs router='cosine', got router={options['router']!r}")
    return ConceptMoEConfig(
        **fields,
        **options,
        concept_loop=list(loop) if isinstance(loop, tuple | list) else loop,
        dechunk_residual="delta",
    )


def rank_window_fields(rank_window: int | None, chunking: str, compression_ratio: float) -> dict[str, Any]:
    """The config fields of learned boundaries decided on local ranks (`concept_ranking`): the window, the
    threshold 1 − 1/R at which about one token in R opens a concept in every text, no decision noise
    (training decides as inference does), and the dechunk EMA at weight 1 with the probability's gradient
    (`dechunk_ema="straight_through"`): ranked openings sit at middling probabilities, and the paper's
    EMA would blur each concept with the ones before it where fixed chunks read it whole. Empty for
    fixed chunking or `rank_window` None / 0."""
    if not rank_window or chunking != "dynamic":
        return {}
    return {
        "boundary_rank_window": rank_window,
        "boundary_threshold": 1.0 - 1.0 / compression_ratio,
        "boundary_noise": "none",
        "dechunk_ema": "straight_through",
    }


def expected_shapes(config) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor a checkpoint of `config` holds (the tied head excluded)."""
    _, ConceptMoEForCausalLM = _model_classes()
    with torch.device("meta"):
        model = ConceptMoEForCausalLM(config)
    shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def conceptmoe_name(plain_name: str, encoder_layers: int, concept_layers: int) -> str:
    """Our name for a plain-family tensor name (`model.layers.{i}.*` goes to its stage)."""
    match = _SOURCE_LAYER.match(plain_name)
    if match is None:
        return plain_name
    index, rest = int(match["index"]), match["rest"]
    if index < encoder_layers:
        return f"model.encoder_layers.{index}.{rest}"
    if index < encoder_layers + concept_layers:
        return f"model.concept_layers.{index - encoder_layers}.{rest}"
    return f"model.decoder_layers.{index - encoder_layers - concept_layers}.{rest}"


def new_tensor(name: str, shape: tuple[int, ...], config, generator: torch.Generator) -> torch.Tensor | None:
    """Initial value of a tensor the source does not have; None when `name` is not one we add."""
    if name in ("model.chunker.boundary_query.weight", "model.chunker.boundary_key.weight"):
        if config.router_init == "identity":
            return torch.eye(*shape)
        return torch.randn(shape, generator=generator) * config.initializer_range
    if name == "model.chunker.score.weight":
        return torch.randn(shape, generator=generator) * config.initializer_range
    if name == "model.chunker.score.bias" or _JOINT_PROJECTOR.search(name):
        # Zero projectors: joint decoding starts as a no-op, so the converted model equals the source.
        return torch.zeros(shape)
    if _JOINT_NORM.search(name):
        # Unit gain: the zero projectors read concepts at the scale q/k/v_proj read their normed input.
        return torch.ones(shape)
    return None


def _source_tensors(
    src: Path, model_type: str, config, allow_pickle: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """(our name, tensor) for every source tensor, in the source's order; the tied head is dropped."""
    concept_layers = config.num_concept_layers
    for key, tensor in iter_source_tensors(src, allow_pickle=allow_pickle):
        for plain_name, value in plain_tensors(key, tensor, model_type):
            if config.tie_word_embeddings and plain_name == "lm_head.weight":
                continue
            yield conceptmoe_name(plain_name, config.encoder_layers, concept_layers), value


def converted_tensors(
    src: Path,
    model_type: str,
    config,
    shapes: dict[str, tuple[int, ...]],
    dtype: torch.dtype,
    allow_pickle: bool,
    seed: int,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream the checkpoint's tensors: the source's, renamed and checked against `shapes`, then the new
    ones. Raises ValueError naming shape mismatches, unused source keys and missing tensors."""
    filled: set[str] = set()
    unused: list[str] = []
    for name, tensor in _source_tensors(src, model_type, config, allow_pickle):
        if name not in shapes:
            unused.append(name)
            continue
        if name in filled:
            raise ValueError(f"{src}: tensor {name!r} appears twice in the source")
        if tuple(tensor.shape) != shapes[name]:
            raise ValueError(
                f"{src}: shape mismatch for {name!r}: the source has {tuple(tensor.shape)}, "
                f"the ConceptMoE config needs {shapes[name]} (does config.json match the weights?)"
            )
        filled.add(name)
        yield name, tensor.to(dtype)
    generator = torch.Generator().manual_seed(seed)
    missing = []
    for name in sorted(set(shapes) - filled):
        value = new_tensor(name, shapes[name], config, generator)
        if value is None:
            missing.append(name)
            continue
        yield name, value.to(dtype)
    if missing or unused:
        raise ValueError(
            f"{src}: tensors missing from the source: {missing}; unused source tensors: {unused}"
        )


def _write_checkpoint(
    src: Path,
    dst: Path,
    config,
    tensors: Iterator[tuple[str, torch.Tensor]],
    total: int,
    dtype: torch.dtype,
    max_shard_size: int | str,
    overwrite: bool,
    card: dict[str, Any],
) -> Path:
    """The `total` tensors as shards, `config` with the remote code, the source's side files and the model
    card (`card`: its base_model and settings) into `dst`, atomically; returns `dst`."""
    ConceptMoEModel, ConceptMoEForCausalLM = _model_classes()
    with atomic_folder(dst, overwrite=overwrite, source=src) as folder:
        write_tensors(folder, tensors, max_shard_size, total=total, description="convert")
        config.dtype = dtype
        config.architectures = [ConceptMoEForCausalLM.__name__]
        model_classes = {"AutoModel": ConceptMoEModel, "AutoModelForCausalLM": ConceptMoEForCausalLM}
        write_config_with_remote_code(folder, config, model_classes)
        copy_side_files(src, folder)
        # The source's own card may state its licence; the converted weights inherit it.
        write_model_card(folder, license=card_license(src), name_or_path=str(dst), **card)
    return dst


def convert_to_conceptmoe(
    src: str | Path,
    dst: str | Path,
    *,
    encoder_layers: int = 2,
    decoder_layers: int = 2,
    compression_ratio: float = 2.0,
    chunking: str = "dynamic",
    joint_decoding_layers: int | None = None,
    concept_loop: Sequence[int] | None = None,
    experts_per_token: int | None = None,
    router: str = "cosine",
    router_init: str = "random",
    pooling: str = "first",
    rank_window: int | None = DEFAULT_RANK_WINDOW,
    fixed_bonus: float = 0.0,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = "2GB",
    overwrite: bool = False,
    allow_pickle: bool = False,
    seed: int = 0,
    base_model: str | None = None,
) -> Path:
    """Convert the source checkpoint folder `src` into a ConceptMoE checkpoint folder `dst`; returns `dst`.

    Options are ConceptMoEConfig fields (`concept_loop` = (start, end, extra passes)); `experts_per_token`
    changes a MoE source's top-k; `rank_window` is `boundary_rank_window` for dynamic chunking (None or
    0: decisions on the probabilities, one threshold for every text; `rank_window_fields`); `fixed_bonus`
    is `boundary_fixed_bonus` (a learned router held near fixed chunks; needs the rank window); `dtype`
    defaults to the source's; `base_model` names the source in the model card (default: the `src` path).
    Raises ValueError, with `dst` left untouched, for an unsupported model_type, a bad option,
    missing/corrupt shards, NaN/inf weights, shape mismatches, `.bin` weights without
    `allow_pickle=True`, a `dst` that is, contains or lies inside `src` (even with `overwrite=True`), or an
    existing non-empty `dst` without `overwrite=True`.
    """
    src = Path(src)
    dst = check_destination(dst, overwrite, source=src)
    parse_size(max_shard_size)
    source_config = read_source_config(src)
    config = conceptmoe_config_from_source(
        source_config,
        encoder_layers=encoder_layers,
        decoder_layers=decoder_layers,
        compression_ratio=compression_ratio,
        chunking=chunking,
        joint_decoding_layers=joint_decoding_layers,
        concept_loop=concept_loop,
        experts_per_token=experts_per_token,
        router=router,
        router_init=router_init,
        pooling=pooling,
        rank_window=rank_window,
        boundary_fixed_bonus=fixed_bonus,
    )
    dtype = resolve_dtype(dtype, source_config)
    check_safetensors_files(src)
    shapes = expected_shapes(config)
    tensors = converted_tensors(src, source_config.model_type, config, shapes, dtype, allow_pickle, seed)
    card = {"base_model": base_model or str(src), "settings": {"source_model_type": source_config.model_type}}
    return _write_checkpoint(src, dst, config, tensors, len(shapes), dtype, max_shard_size, overwrite, card)
