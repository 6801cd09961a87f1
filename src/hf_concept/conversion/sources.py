"""Read a source checkpoint folder into the plain decoder family, exactly.

Sources: llama, mistral, qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe (transformers 5.23 configs).
Weights are read from safetensors as they lie on disk, shard by shard and tensor by tensor:
- dense keys are already our names (`model.layers.N.self_attn.q_proj.weight`, ...);
- MoE experts are per expert on disk (what `save_pretrained` writes by default): Mixtral
  `block_sparse_moe.experts.N.w1/w2/w3` and `block_sparse_moe.gate` become `mlp.experts.N.gate_proj/
  down_proj/up_proj` and `mlp.gate`; Qwen-MoE keys (`mlp.experts.N.*`, `mlp.gate`, `mlp.shared_expert.*`,
  `mlp.shared_expert_gate`) are already ours;
- fused v5 expert tensors (`mlp.experts.gate_up_proj` (E, 2I, D), `mlp.experts.down_proj` (E, D, I),
  written with `save_original_format=False`) are split per expert.
`.bin` files are refused unless `allow_pickle=True` (and then read with `weights_only=True`).
Every floating tensor is checked for NaN and inf as it is read (`check_finite`), so a corrupt data
section is named (tensor and file) instead of converted into a model that outputs NaN.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from hf_concept.modeling.configuration_plain import PlainDecoderConfig
from hf_concept.modeling.layers import RotaryEmbedding
from hf_concept.modeling.modeling_plain import PlainDecoderForCausalLM
from hf_concept.safetensors_check import safetensors_defect

SUPPORTED_SOURCE_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")
MOE_SOURCE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

_MIXTRAL_EXPERT = re.compile(
    r"^(?P<layer>.*layers\.\d+)\.block_sparse_moe\.experts\.(?P<expert>\d+)\.(?P<w>w[123])\."
)
_MIXTRAL_GATE = re.compile(r"^(?P<layer>.*layers\.\d+)\.block_sparse_moe\.gate\.")
_MIXTRAL_PROJECTIONS = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_FUSED_EXPERTS = re.compile(r"^(?P<layer>.*layers\.\d+)\.mlp\.experts\.(?P<kind>gate_up_proj|down_proj)$")
# Float dtypes torch.aminmax reads directly on CPU; others (float8) are widened first.
_MINMAX_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Buffers some old checkpoints saved; they are recomputed, never loaded.
_DROPPED = re.compile(r"rotary_emb\.inv_freq$")


def check_source_type(model_type: Any) -> str:
    if model_type not in SUPPORTED_SOURCE_TYPES:
        raise ValueError(
            f"model_type={model_type!r} is not a supported source; "
            f"supported: {', '.join(SUPPORTED_SOURCE_TYPES)}"
        )
    return model_type


def read_source_config(folder: str | Path):
    """The source's transformers config, after checking `model_type` in its config.json."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ValueError(f"folder={str(folder)!r} has no config.json")
    check_source_type(json.loads(path.read_text()).get("model_type"))
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(folder))


def _rope_fields(source_config) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from v5's `rope_parameters` (a flat dict for these sources)."""
    parameters = dict(getattr(source_config, "rope_parameters", None) or {})
    if any(isinstance(value, dict) for value in parameters.values()):
        raise ValueError(f"rope_parameters={parameters!r}: per-layer-type RoPE is not supported")
    rope_theta = parameters.pop("rope_theta", None) or getattr(source_config, "rope_theta", 10000.0)
    partial = parameters.pop("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial!r} is not supported (only full rotary)")
    rope_type = parameters.get("rope_type", parameters.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type={rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    if rope_type == "default":
        return rope_theta, None
    parameters.pop("type", None)
    parameters["rope_type"] = rope_type
    if rope_type == "yarn" and parameters.get("factor") is None:
        # transformers' fallback: the ratio of the extended to the original context.
        parameters["factor"] = (
            source_config.max_position_embeddings / parameters["original_max_position_embeddings"]
        )
    return rope_theta, parameters


def _attention_fields(source_config, model_type: str) -> dict[str, Any]:
    """Biases, q/k norm and sliding-window layout, per source semantics."""
    if model_type == "qwen2":
        qkv_bias, output_bias = True, False
    elif model_type == "qwen2_moe":
        qkv_bias, output_bias = bool(source_config.qkv_bias), False
    elif model_type in ("llama", "qwen3", "qwen3_moe"):
        qkv_bias = output_bias = bool(getattr(source_config, "attention_bias", False))
    else:
        qkv_bias = output_bias = False
    window = getattr(source_config, "sliding_window", None)
    layer_types = getattr(source_config, "layer_types", None)
    if layer_types is None:
        # Mistral, Mixtral, Qwen3-MoE: a set window applies to every layer.
        kind = "sliding_attention" if window else "full_attention"
        layer_types = [kind] * source_config.num_hidden_layers
    layer_types = list(layer_types)
    return dict(
        attention_bias=qkv_bias,
        attention_output_bias=output_bias,
        mlp_bias=bool(getattr(source_config, "mlp_bias", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        layer_types=layer_types,
        sliding_window=window if "sliding_attention" in layer_types else None,
    )


def _expert_fields(source_config, model_type: str) -> dict[str, Any]:
    if model_type == "mixtral":
        return dict(
            num_experts=source_config.num_local_experts,
            num_experts_per_tok=source_config.num_experts_per_tok,
            moe_intermediate_size=source_config.intermediate_size,
            norm_topk_prob=True,
        )
    if model_type in ("qwen2_moe", "qwen3_moe"):
        return dict(
            num_experts=source_config.num_experts,
            num_experts_per_tok=source_config.num_experts_per_tok,
            moe_intermediate_size=source_config.moe_intermediate_size,
            shared_expert_intermediate_size=getattr(source_config, "shared_expert_intermediate_size", 0) or 0,
            norm_topk_prob=bool(source_config.norm_topk_prob),
            decoder_sparse_step=source_config.decoder_sparse_step,
            mlp_only_layers=list(source_config.mlp_only_layers or []),
        )
    return dict(num_experts=0)


def plain_config_from_source(source_config) -> PlainDecoderConfig:
    """A `PlainDecoderConfig` that makes `PlainDecoderForCausalLM` compute what the source model computes."""
    model_type = check_source_type(getattr(source_config, "model_type", None))
    heads = source_config.num_attention_heads
    rope_theta, rope_scaling = _rope_fields(source_config)
    return PlainDecoderConfig(
        vocab_size=source_config.vocab_size,
        hidden_size=source_config.hidden_size,
        intermediate_size=source_config.intermediate_size,
        num_hidden_layers=source_config.num_hidden_layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(source_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(source_config, "head_dim", None) or source_config.hidden_size // heads,
        hidden_act=source_config.hidden_act,
        max_position_embeddings=source_config.max_position_embeddings,
        initializer_range=source_config.initializer_range,
        rms_norm_eps=source_config.rms_norm_eps,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        attention_dropout=float(getattr(source_config, "attention_dropout", 0.0)),
        tie_word_embeddings=bool(getattr(source_config, "tie_word_embeddings", False)),
        pad_token_id=source_config.pad_token_id,
        bos_token_id=source_config.bos_token_id,
        eos_token_id=source_config.eos_token_id,
        **_attention_fields(source_config, model_type),
        **_expert_fields(source_config, model_type),
    )


def source_key_to_plain(key: str, model_type: str) -> str | None:
    """Our parameter name for one on-disk source key; None for keys that are dropped on purpose
    (saved RoPE buffers). Fused expert tensors map to several names: see `plain_tensors`."""
    check_source_type(model_type)
    if _DROPPED.search(key):
        return None
    if model_type == "mixtral":
        if match := _MIXTRAL_EXPERT.match(key):
            projection = _MIXTRAL_PROJECTIONS[match["w"]]
            suffix = key[match.end() :]
            return f"{match['layer']}.mlp.experts.{match['expert']}.{projection}.{suffix}"
        if match := _MIXTRAL_GATE.match(key):
            return f"{match['layer']}.mlp.gate.{key[match.end() :]}"
    return key


def plain_tensors(key: str, tensor: torch.Tensor, model_type: str) -> list[tuple[str, torch.Tensor]]:
    """(our name, tensor) pairs for one source tensor: one pair, several for a fused expert tensor,
    none for a dropped key."""
    if model_type in MOE_SOURCE_TYPES and (match := _FUSED_EXPERTS.match(key)):
        prefix = f"{match['layer']}.mlp.experts"
        if match["kind"] == "down_proj":
            return [(f"{prefix}.{index}.down_proj.weight", part) for index, part in enumerate(tensor)]
        pairs = []
        for index, part in enumerate(tensor):
            # (2I, D): gate rows first, then up rows (transformers chunks in that order).
            gate, up = part.chunk(2, dim=0)
            pairs += [(f"{prefix}.{index}.gate_proj.weight", gate), (f"{prefix}.{index}.up_proj.weight", up)]
        return pairs
    name = source_key_to_plain(key, model_type)
    return [] if name is None else [(name, tensor)]


def _safetensors_files(folder: Path) -> list[tuple[Path, set[str] | None]]:
    """Files to read and, for sharded folders, the keys the index promises in each."""
    index_path = folder / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
        promised: dict[str, set[str]] = {}
        for key, file_name in weight_map.items():
            promised.setdefault(file_name, set()).add(key)
        missing = sorted(name for name in promised if not (folder / name).is_file())
        if missing:
            raise ValueError(f"model.safetensors.index.json in {folder} names missing shards: {missing}")
        return [(folder / name, keys) for name, keys in promised.items()]
    if (folder / "model.safetensors").is_file():
        return [(folder / "model.safetensors", None)]
    return []


def _pickle_files(folder: Path) -> list[Path]:
    index_path = folder / "pytorch_model.bin.index.json"
    if index_path.is_file():
        names = dict.fromkeys(json.loads(index_path.read_text())["weight_map"].values())
        return [folder / name for name in names]
    return sorted(folder.glob("*.bin"))


def iter_source_tensors(folder: str | Path, allow_pickle: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (on-disk key, tensor) one at a time, shard by shard (safetensors are memory-mapped)."""
    folder = Path(folder)
    files = _safetensors_files(folder)
    for path, promised in files:
        yield from _shard_tensors(path, promised)
    if files:
        return
    pickles = _pickle_files(folder)
    if not pickles:
        raise ValueError(
            f"folder={str(folder)!r} has no model.safetensors, safetensors index or .bin weights"
        )
    if not allow_pickle:
        raise ValueError(
            f"folder={str(folder)!r} holds only PyTorch .bin weights ({', '.join(p.name for p in pickles)}); "
            "reading them unpickles data: convert them to safetensors, "
            "or pass allow_pickle=True for a trusted source"
        )
    for path in pickles:
        for key, tensor in torch.load(path, map_location="cpu", weights_only=True).items():
            yield key, check_finite(key, tensor, path)


def _shard_tensors(path: Path, promised: set[str] | None) -> Iterator[tuple[str, torch.Tensor]]:
    """One safetensors shard's tensors; a file safetensors cannot read raises ValueError naming it."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as shard:
            keys = list(shard.keys())
            if promised is not None and not promised <= set(keys):
                raise ValueError(f"{path.name} lacks keys its index lists: {sorted(promised - set(keys))}")
            for key in keys:
                yield key, check_finite(key, shard.get_tensor(key), path)
    except (OSError, SafetensorError) as error:
        raise ValueError(f"file={str(path)!r} could not be read as safetensors: {error}") from error


def check_finite(key: str, tensor: torch.Tensor, path: Path) -> torch.Tensor:
    """`tensor`, after checking that a floating tensor holds no NaN or inf; ValueError naming the key and
    the file otherwise (random bytes over a shard's data section usually decode to some)."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return tensor
    # aminmax reads the tensor once without a full-size temporary (isfinite(t).all() needs one); it
    # propagates NaN, and an inf is always the minimum or the maximum.
    values = tensor if tensor.dtype in _MINMAX_DTYPES else tensor.float()
    low, high = torch.aminmax(values)
    if not (torch.isfinite(low) and torch.isfinite(high)):
        raise ValueError(
            f"tensor {key!r} in source file {str(path)!r} holds NaN or inf values: the file is corrupt "
            "(or the weights diverged in training)"
        )
    return tensor


def _empty_plain_model(config: PlainDecoderConfig, dtype: torch.dtype) -> PlainDecoderForCausalLM:
    """Allocated but unfilled model: built on the meta device so nothing is randomly initialised."""
    with torch.device("meta"):
        model = PlainDecoderForCausalLM(config)
    model = model.to(dtype=dtype).to_empty(device="cpu")
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset_inv_freq()
    return model


def _fill_parameters(
    model: PlainDecoderForCausalLM, folder: Path, model_type: str, allow_pickle: bool
) -> None:
    """Copy every source tensor into its parameter; raise naming any missing parameter or unused key."""
    targets = dict(model.named_parameters())
    tied = model.config.tie_word_embeddings
    filled: set[str] = set()
    unused: list[str] = []
    tied_head = None
    for key, tensor in iter_source_tensors(folder, allow_pickle=allow_pickle):
        for name, value in plain_tensors(key, tensor, model_type):
            if tied and name == "lm_head.weight":
                # Some tied checkpoints also store the head; it must equal the embedding it is tied to.
                tied_head = value
                continue
            if name not in targets:
                unused.append(key)
                continue
            if name in filled:
                raise ValueError(f"source key {key!r} fills {name!r} a second time")
            if tuple(value.shape) != tuple(targets[name].shape):
                raise ValueError(
                    f"source key {key!r} has shape {tuple(value.shape)}, "
                    f"{name!r} needs {tuple(targets[name].shape)}"
                )
            with torch.no_grad():
                targets[name].copy_(value)
            filled.add(name)
    missing = sorted(set(targets) - filled)
    if missing or unused:
        raise ValueError(
            f"{folder}: parameters missing from the source: {missing}; unused source keys: {unused}"
        )
    if tied_head is not None and not torch.equal(
        tied_head.to(model.lm_head.weight.dtype), model.lm_head.weight
    ):
        raise ValueError(f"{folder}: tie_word_embeddings=True but lm_head.weight differs from embed_tokens")


def load_source_into_plain(
    folder: str | Path, allow_pickle: bool = False, dtype: torch.dtype | None = None
) -> PlainDecoderForCausalLM:
    """Build the plain model for a source checkpoint folder and load every tensor into it.

    `dtype` defaults to the source config's dtype (float32 when it has none). Returns the model in eval
    mode. Raises ValueError for an unsupported model_type, a missing parameter, an unused source key or a
    shape mismatch.
    """
    folder = Path(folder)
    source_config = read_source_config(folder)
    config = plain_config_from_source(source_config)
    source_dtype = getattr(source_config, "dtype", None)
    dtype = dtype or (source_dtype if isinstance(source_dtype, torch.dtype) else torch.float32)
    model = _empty_plain_model(config, dtype)
    if config.tie_word_embeddings and model.lm_head.weight is not model.model.embed_tokens.weight:
        model.tie_weights()
    _fill_parameters(model, folder, source_config.model_type, allow_pickle)
    model.config.dtype = dtype
    return model.eval()


def check_safetensors_files(folder: Path) -> None:
    """Check the header and length of every safetensors file of a source folder before anything is
    written, so that a truncated or corrupt shard is named instead of failing deep inside a read."""
    index_path = folder / "model.safetensors.index.json"
    if index_path.is_file():
        try:
            names = dict.fromkeys(json.loads(index_path.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{index_path} is not a valid safetensors index: {error}") from None
    else:
        names = [name for name in ("model.safetensors",) if (folder / name).is_file()]
    for name in names:
        path = folder / name
        if not path.is_file():
            raise ValueError(f"source shard {path} is listed in {index_path.name} but missing")
        _check_safetensors_file(path)


def _check_safetensors_file(path: Path) -> None:
    defect = safetensors_defect(path)
    if defect is None:
        return
    if defect.kind == "length":
        raise ValueError(f"source shard {path} is corrupt or truncated: its header does not fit the file")
    if defect.kind == "header":
        raise ValueError(f"source shard {path} is corrupt: its header is not valid safetensors")
    raise ValueError(
        f"source shard {path} is corrupt or truncated: "
        f"it has {defect.size} bytes, its header describes {defect.expected}"
    )
