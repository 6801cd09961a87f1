"""Per-token compute and parameters of a ConceptMoE config against its source (ConceptMoE §3.5, §4.5).

The paper compares architectures at matched FLOPs and parameters; this counts both from the modules a
config builds (on the meta device: nothing is allocated), so every projection is counted once and none
is forgotten.

Conventions:
- parameters: every parameter of the model; *active* parameters: those one token's forward touches, with
  a MoE block's experts weighted by top-k / experts (routing assumed balanced) and the concept stack's
  modules by how often they run per token (below); embeddings count as parameters, not as FLOPs.
- matmul FLOPs per token: 2 × the active matmul weights (one multiply-add per weight), where a module
  runs per token (encoder, decoder, router, LM head) or per concept (concept layers, once per pass of
  `concept_loop`, and the concept in/out projections: 1/R per token at compression ratio R).
- attention FLOPs per token: one decoding step at context L: 4 · heads · head dim · keys per layer (the
  score and the value products), L keys for a token layer and L/R for a concept layer (run 1/R of the
  time). Norms, activations, softmax, RoPE, the EMA and the routers' cosine are not counted.
- the source: the plain decoder with the config's backbone fields, `num_hidden_layers` token layers and
  the source's top-k (`num_experts_per_tok`), as `hf-concept convert` reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class ComputeReport:
    """Per-token compute of one model at one context length (module docstring)."""

    parameters: int
    active_parameters: float
    matmul_flops: float
    attention_flops: float

    @property
    def flops(self) -> float:
        return self.matmul_flops + self.attention_flops


def _stage_runs(name: str, config: Any) -> float:
    """How often the module `name` runs per token."""
    ratio = getattr(config, "compression_ratio", 1.0)
    if name.startswith("model.chunker.") and getattr(config, "chunking", None) == "fixed":
        # Fixed chunking never runs the router it was built with.
        return 0.0
    if name.startswith("model.concept_layers."):
        index = int(name.split(".")[2])
        return config.concept_layer_schedule().count(index) / ratio
    if name.startswith(("model.concept_in_proj", "model.concept_out_proj")):
        return 1.0 / ratio
    return 1.0


def _expert_share(model: nn.Module, name: str) -> float:
    """top-k / experts for a parameter inside a MoE block's experts, else 1."""
    if ".experts." not in name:
        return 1.0
    block = model.get_submodule(name.split(".experts.")[0])
    return block.top_k / len(block.experts)


def _attention_flops(model: nn.Module, config: Any, context_length: int) -> float:
    ratio = getattr(config, "compression_ratio", 1.0)
    total = 0.0
    for name, module in model.named_modules():
        if not name.endswith("self_attn"):
            continue
        per_key = 4 * module.num_heads * module.head_dim
        runs = _stage_runs(name, config)
        keys = context_length / ratio if name.startswith("model.concept_layers.") else context_length
        total += runs * per_key * keys
    return total


def model_compute(model: nn.Module, config: Any, context_length: int) -> ComputeReport:
    """The `ComputeReport` of a built model (any device, meta included)."""
    active = 0.0
    matmul = 0.0
    # Tied weights are listed under each name: a tied LM head still runs a matmul per token.
    for name, parameter in model.named_parameters(remove_duplicate=False):
        weight = _stage_runs(name, config) * _expert_share(model, name) * parameter.numel()
        if "embed_tokens" not in name:
            active += weight
        module = model.get_submodule(name.rsplit(".", 1)[0])
        if isinstance(module, nn.Linear) and name.endswith(".weight"):
            matmul += 2 * weight
    return ComputeReport(
        parameters=sum(parameter.numel() for parameter in model.parameters()),
        active_parameters=active,
        matmul_flops=matmul,
        attention_flops=_attention_flops(model, config, context_length),
    )


def source_config_of(config: Any) -> Any:
    """The plain decoder a ConceptMoE config was (or would be) converted from: its backbone fields."""
    from hf_concept.modeling.configuration_plain import PlainDecoderConfig

    names = {name for name in PlainDecoderConfig().to_dict() if hasattr(config, name)}
    values = {name: getattr(config, name) for name in names}
    for key in ("model_type", "architectures", "auto_map", "transformers_version", "dtype", "torch_dtype"):
        values.pop(key, None)
    return PlainDecoderConfig(**values)


def conceptmoe_compute(config: Any, context_length: int = 4096) -> tuple[ComputeReport, ComputeReport]:
    """(the ConceptMoE's report, its source's report) at `context_length`."""
    from hf_concept.modeling.modeling_conceptmoe import ConceptMoEForCausalLM
    from hf_concept.modeling.modeling_plain import PlainDecoderForCausalLM

    if not (isinstance(context_length, int) and context_length > 0):
        raise ValueError(f"context_length={context_length!r} must be a positive integer")
    source_config = source_config_of(config)
    with torch.device("meta"):
        model = ConceptMoEForCausalLM(config)
        source = PlainDecoderForCausalLM(source_config)
    return model_compute(model, config, context_length), model_compute(source, source_config, context_length)
