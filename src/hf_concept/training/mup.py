"""Decoupled μP optimizer groups for DLCM (paper §6.1, eq. 18–20).

Each trainable parameter lands in exactly one of three groups:

- "token": hidden matrices of the encoder, the router and the decoder (width d_token), learning rate
  η_token / s_token and AdamW ε / s_token;
- "concept": hidden matrices that read or write the concept width (W_up, concept layers, smoothing,
  cross-attention K/V), learning rate η_concept / s_concept and ε / s_concept;
- "others": embeddings, norms, biases, the LM head and the null concept, at the fixed η_others and ε.

s = width / `mup_base_width`, both 1 without μP (then every group keeps its base rate). Which stage a
parameter belongs to is `modeling_dlcm.mup_stage_of`, applied after the PEFT wrapper segments are removed
from its name, so a LoRA adapter of a hidden matrix trains at that matrix's rate.

Use with `Trainer`: `Trainer(..., optimizers=(mup_optimizer(model), None))`. The Trainer then builds its
learning-rate scheduler on this optimizer; schedules multiply each group's own rate, so the ratios hold.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from hf_concept.modeling.modeling_dlcm import mup_stage_of

MUP_GROUPS = ("token", "concept", "others")

# PEFT's module wrappers add these name segments around the wrapped layer's own parameter names
# ("…q_proj.base_layer.weight", "…q_proj.lora_A.default.weight", "…modules_to_save.default.weight").
_PEFT_PREFIX = "base_model.model."
_PEFT_SEGMENT = re.compile(
    r"\.(?:base_layer|original_module)(?=\.)"
    r"|\.(?:lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector|modules_to_save)\.[^.]+(?=\.)"
)


def base_parameter_name(name: str) -> str:
    """The parameter's name in the unwrapped model: PEFT's prefix and wrapper segments removed."""
    return _PEFT_SEGMENT.sub("", name.removeprefix(_PEFT_PREFIX))


def mup_group_of(name: str) -> str:
    """The μP group ("token", "concept" or "others") of a possibly PEFT-wrapped parameter name."""
    return mup_stage_of(base_parameter_name(name)) or "others"


def _mup_config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "mup_token_scale"):
        raise ValueError(
            f"model={type(model).__name__}: mup_param_groups needs a DLCM model (a config with mup_* fields)"
        )
    return config


def _checked_rate(name: str, value: float | None, default: float) -> float:
    rate = default if value is None else value
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0:
        raise ValueError(f"{name}={rate!r} must be a positive number")
    return float(rate)


def mup_param_groups(
    model: nn.Module,
    *,
    token_lr: float | None = None,
    concept_lr: float | None = None,
    other_lr: float | None = None,
    weight_decay: float = 0.0,
    eps: float = 1e-8,
) -> list[dict[str, Any]]:
    """Optimizer param groups of decoupled μP for a DLCM model (plain, PEFT-wrapped or the bare backbone).

    `token_lr` / `concept_lr` / `other_lr` are the base rates η (defaults: the config's
    `mup_token_learning_rate`, `mup_concept_learning_rate`, `mup_other_learning_rate`); the token and
    concept groups get η / s and ε / s. `weight_decay` applies to the two hidden-matrix groups only (the
    others hold norms, biases and embeddings). Only trainable parameters are grouped; empty groups are
    left out. Each dict carries its "name" (`MUP_GROUPS`) and "width_scale" s.
    """
    config = _mup_config(model)
    rates = {
        "token": _checked_rate("token_lr", token_lr, config.mup_token_learning_rate),
        "concept": _checked_rate("concept_lr", concept_lr, config.mup_concept_learning_rate),
        "others": _checked_rate("other_lr", other_lr, config.mup_other_learning_rate),
    }
    eps = _checked_rate("eps", eps, eps)
    if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)) or weight_decay < 0:
        raise ValueError(f"weight_decay={weight_decay!r} must be a non-negative number")
    scales = {"token": config.mup_token_scale, "concept": config.mup_concept_scale, "others": 1.0}
    members: dict[str, list[nn.Parameter]] = {group: [] for group in MUP_GROUPS}
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            members[mup_group_of(name)].append(parameter)
    groups = []
    for group, params in members.items():
        if not params:
            continue
        scale = scales[group]
        groups.append(
            {
                "name": group,
                "params": params,
                "lr": rates[group] / scale,
                "eps": eps / scale,
                "weight_decay": 0.0 if group == "others" else float(weight_decay),
                "width_scale": scale,
            }
        )
    _check_partition(model, groups)
    return groups


def _check_partition(model: nn.Module, groups: list[dict[str, Any]]) -> None:
    """Every trainable parameter sits in exactly one group (shared tensors included)."""
    seen: dict[int, str] = {}
    for group in groups:
        for parameter in group["params"]:
            if id(parameter) in seen:
                raise ValueError(
                    f"a parameter is in both group {seen[id(parameter)]!r} and {group['name']!r}"
                )
            seen[id(parameter)] = group["name"]
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    if trainable != set(seen):
        raise ValueError(
            f"μP groups hold {len(seen)} parameters but the model has {len(trainable)} trainable ones"
        )


def mup_optimizer(
    model: nn.Module,
    *,
    token_lr: float | None = None,
    concept_lr: float | None = None,
    other_lr: float | None = None,
    weight_decay: float = 0.0,
    eps: float = 1e-8,
    betas: tuple[float, float] = (0.9, 0.999),
) -> torch.optim.AdamW:
    """AdamW over `mup_param_groups(model, ...)`; hand it to `Trainer(optimizers=(optimizer, None))`."""
    groups = mup_param_groups(
        model,
        token_lr=token_lr,
        concept_lr=concept_lr,
        other_lr=other_lr,
        weight_decay=weight_decay,
        eps=eps,
    )
    return torch.optim.AdamW(groups, betas=betas)
