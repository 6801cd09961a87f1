"""PEFT target lists and the boundary router. The router's
projections are `chunker.boundary_query`/`boundary_key`, which no attention target list matches (they
were `q_proj`/`k_proj`, so the usual `["q_proj", "v_proj"]` LoRA trained the segmentation);
`hf_concept.training.LORA_ATTENTION_TARGETS` (what `hf-concept train --lora` uses) matches every
attention projection, cross- and joint-attention included, and `LORA_EXPERT_TARGETS` a MoE's experts."""

from __future__ import annotations

import pytest
import torch

from hf_concept.training import LORA_ATTENTION_TARGETS, LORA_EXPERT_TARGETS
from tests.conformance.families import (
    _conceptmoe_class,
    _conceptmoe_mean_moe_config,
    _dlcm_class,
    _dlcm_config,
)

peft = pytest.importorskip("peft")

FAMILIES = {
    "conceptmoe": (_conceptmoe_class, _conceptmoe_mean_moe_config),
    "dlcm": (_dlcm_class, _dlcm_config),
}


def build(family: str):
    class_of, make_config = FAMILIES[family]
    torch.manual_seed(0)
    return class_of()(make_config())


def wrapped(model) -> set[str]:
    """Names of the modules PEFT replaced by LoRA layers."""
    return {name for name, module in model.named_modules() if hasattr(module, "lora_A")}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_no_default_target_list_of_peft_matches_the_router(family):
    """PEFT's own matching rule (a name, a ".name" suffix, or a regex's full match) over its default
    targets of every architecture it knows."""
    from peft.tuners.tuners_utils import check_target_module_exists
    from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

    routers = [name for name, _ in build(family).named_modules() if ".chunker." in name]
    assert {name.rsplit(".", 1)[1] for name in routers} == {"boundary_query", "boundary_key"}
    for model_type, targets in DEFAULTS.items():
        config = peft.LoraConfig(target_modules=targets)
        matched = [name for name in routers if check_target_module_exists(config, name)]
        assert not matched, (model_type, matched)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_usual_q_v_lora_adapts_attention_and_leaves_the_router_untouched(family):
    model = build(family)
    router_before = {name: value.clone() for name, value in model.named_parameters() if "chunker" in name}
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    names = wrapped(adapted)
    assert names and all(".self_attn." in name or ".cross_attn." in name for name in names), names
    optimizer = torch.optim.AdamW([p for p in adapted.parameters() if p.requires_grad], lr=1e-2)
    input_ids = torch.randint(3, 60, (2, 16), generator=torch.Generator().manual_seed(1))
    adapted(input_ids=input_ids, labels=input_ids).loss.backward()
    optimizer.step()
    for name, value in adapted.get_base_model().named_parameters():
        if name in router_before:
            assert torch.equal(value, router_before[name]), name


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_attention_targets_leave_the_router_untouched_through_training(family):
    model = build(family)
    router_before = {name: value.clone() for name, value in model.named_parameters() if "chunker" in name}
    assert router_before, "the family has a learned router: the test must see it"
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=LORA_ATTENTION_TARGETS))
    names = wrapped(adapted)
    assert names and not any("chunker" in name for name in names), names
    assert all(".self_attn." in name or ".cross_attn." in name for name in names), names
    optimizer = torch.optim.AdamW([p for p in adapted.parameters() if p.requires_grad], lr=1e-2)
    input_ids = torch.randint(3, 60, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        adapted(input_ids=input_ids, labels=input_ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    for name, value in adapted.get_base_model().named_parameters():
        if name in router_before:
            assert torch.equal(value, router_before[name]), name


def test_expert_targets_adapt_every_expert_and_merge_to_the_same_logits():
    model = build("conceptmoe")
    experts = {
        name
        for name, _ in model.named_modules()
        if (".experts." in name or ".shared_expert." in name) and name.endswith("_proj")
    }
    # Random adapters (not PEFT's zero-initialised B), so that merging has something to merge.
    config = peft.LoraConfig(r=4, target_modules=LORA_EXPERT_TARGETS, init_lora_weights=False)
    adapted = peft.get_peft_model(model, config)
    names = {name.removeprefix("base_model.model.") for name in wrapped(adapted)}
    assert experts and names == experts
    input_ids = torch.randint(3, 60, (1, 12), generator=torch.Generator().manual_seed(2))
    adapted.eval()
    with torch.no_grad():
        expected = adapted(input_ids=input_ids).logits
        merged = adapted.merge_and_unload()(input_ids=input_ids).logits
    torch.testing.assert_close(merged, expected, atol=1e-5, rtol=1e-5)
