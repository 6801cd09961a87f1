"""One test per difference the compatibility layer (`modeling/transformers_compat.py`) translates, under
whichever supported transformers release is installed; `scripts/version_matrix.py` runs them under each."""

from __future__ import annotations

import functools
import inspect
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
import transformers
from transformers import DynamicCache, Trainer, TrainingArguments
from transformers.masking_utils import create_causal_mask
from transformers.utils.deprecation import deprecate_kwarg

from hf_concept.modeling import transformers_compat as compat
from tests.conformance.families import FAMILIES
from tests.conftest import DeprecatedCallError

SPECS = {spec.name: spec for spec in FAMILIES}


def tiny(name: str = "plain") -> torch.nn.Module:
    torch.manual_seed(0)
    spec = SPECS[name]
    return spec.model_class()(spec.make_config()).eval()


def test_the_cache_name_is_the_one_the_mask_utilities_and_generate_use():
    assert compat.CACHE_NAME in inspect.signature(create_causal_mask).parameters
    model = tiny()
    seen = []
    forward = model.forward

    @functools.wraps(forward)
    def recording(*args, **kwargs):
        seen.append(kwargs)
        return forward(*args, **kwargs)

    model.forward = recording
    model.generation_config.eos_token_id = None
    model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False)
    # generate hands the cache over under the release's name, and reads it back from the output.
    assert all(compat.CACHE_NAME in kwargs for kwargs in seen) and len(seen) == 2
    assert isinstance(seen[1][compat.CACHE_NAME], DynamicCache)


@pytest.mark.parametrize("name", ["plain", "conceptmoe-first", "dlcm", "hidden-decoding", "lslm"])
def test_outputs_take_and_give_the_cache_under_both_names(name):
    model = tiny(name)
    output = model(torch.tensor([[5, 6, 7, 8]]), use_cache=True)
    cache = output.cache
    assert cache is not None and getattr(output, compat.CACHE_NAME) is cache
    assert output[compat.CACHE_NAME] is cache and compat.output_cache(output) is cache
    fields = list(output.keys())
    assert fields[0] == "logits" and fields[1] == compat.CACHE_NAME, fields
    # The cache is read back under the name generate reads (a tuple view keeps the order).
    assert output.to_tuple()[1] is cache


def test_take_cache_accepts_the_old_name_and_refuses_both():
    cache = DynamicCache()
    kwargs = {"past_key_values": cache}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert compat.take_cache(None, kwargs) is cache and kwargs == {}
    deprecated = [w for w in caught if issubclass(w.category, FutureWarning)]
    # From 5.24 the old name is deprecated (removed in 5.40); before, it is the name generate passes.
    assert len(deprecated) == (1 if compat.CACHE_NAME == "cache" else 0)
    assert compat.take_cache(cache, {}) is cache
    with pytest.raises(ValueError, match="pass the cache once"):
        compat.take_cache(cache, {"past_key_values": DynamicCache()})


def test_a_forward_given_the_old_name_equals_one_given_the_new():
    model = tiny("conceptmoe-first")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        new = model(ids[:, :4], use_cache=True)
        new_step = model(ids[:, 4:], cache=new.cache).logits
        old = model(ids[:, :4], use_cache=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            old_step = model(ids[:, 4:], past_key_values=old.cache).logits
    torch.testing.assert_close(old_step, new_step, rtol=0, atol=0)


def test_activation_checkpointing_drops_the_cache_from_checkpointed_layers():
    """transformers' checkpointing drops a layer's cache argument by its release's name (`cache_kwarg`):
    a cache updated inside a checkpointed layer would be updated again by the backward replay."""
    model = tiny().train()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    assert model(ids, labels=ids, use_cache=True).cache.get_seq_length() == 6
    compat.enable_activation_checkpointing(model, {"use_reentrant": False})
    layers = [
        m for m in model.modules() if isinstance(m, transformers.modeling_layers.GradientCheckpointingLayer)
    ]
    assert layers and all(layer.gradient_checkpointing for layer in layers)
    output = model(ids, labels=ids, use_cache=True)
    output.loss.backward()
    assert output.cache.get_seq_length() == 0
    compat.disable_activation_checkpointing(model)
    assert not any(layer.gradient_checkpointing for layer in layers)


def test_checkpointing_arguments_name_the_release_field(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], **compat.checkpointing_arguments(True))
    field = "activation_checkpointing" if compat.ACTIVATION_CHECKPOINTING else "gradient_checkpointing"
    assert getattr(args, field) is True
    model = tiny()
    trainer = Trainer(model=model, args=args)
    assert trainer.args is args


def test_the_cache_keys_are_ignored_at_inference_under_both_names():
    for spec in FAMILIES:
        config = spec.make_config()
        assert {"cache", "past_key_values"} <= set(config.keys_to_ignore_at_inference), spec.name
        assert {"cache", "past_key_values"} <= set(spec.model_class()._skip_keys_device_placement), spec.name


def test_releases_outside_the_range_are_named_in_one_line():
    below = compat.unsupported_reason("5.14.1")
    assert below is not None and "5.14.1" in below and f">={compat.MIN_TRANSFORMERS}" in below
    above = compat.unsupported_reason("6.0.0")
    assert above is not None and "hf-concept upgrade" in above and "\n" not in above + below
    assert compat.unsupported_reason(compat.MIN_TRANSFORMERS) is None
    assert compat.unsupported_reason(compat.NEWEST_TESTED_TRANSFORMERS) is None
    assert compat.untested_note(compat.NEWEST_TESTED_TRANSFORMERS) is None
    assert "tested with" in compat.untested_note("5.99.0")
    with pytest.raises(ImportError, match="needs transformers>="):
        compat.check_transformers_version("5.14.1")
    with pytest.warns(UserWarning, match="runs under 5.99.0"):
        compat.check_transformers_version("5.99.0")


def test_a_saved_checkpoint_under_a_release_below_the_floor_says_so_in_one_line(tmp_path):
    folder = tmp_path / "plain"
    tiny().save_pretrained(folder)
    script = f"""
import sys
sys.modules["hf_concept"] = None
import transformers
transformers.__version__ = "5.14.1"
from transformers import AutoConfig
try:
    AutoConfig.from_pretrained({str(folder)!r}, trust_remote_code=True)
except ImportError as error:
    print("ImportError:", error)
"""
    environment = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules")}
    environment.pop(compat.IGNORE_RANGE_VARIABLE, None)
    result = subprocess.run(
        [sys.executable, "-I", "-c", script], capture_output=True, text=True, env=environment, timeout=300
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("ImportError")]
    assert len(lines) == 1, result.stdout + result.stderr[-2000:]
    assert "found 5.14.1" in lines[0] and "pip install" in lines[0]


def test_the_suite_fails_on_a_deprecation_transformers_raises_against_project_code():
    @deprecate_kwarg("old_name", "99.0.0", new_name="new_name")
    def renamed(new_name=None):
        return new_name

    with pytest.raises(DeprecatedCallError, match=r"test_transformers_compat\.py"):
        renamed(old_name=1)
    assert renamed(new_name=2) == 2


def test_the_config_json_records_nothing_release_specific(tmp_path):
    tiny("dlcm").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert "cache" not in config and "past_key_values" not in config


def test_the_pins_name_the_range_this_module_states():
    """pyproject.toml's range, the CI pin (scripts/setup.sh) and the remote code's range are one range."""
    import re
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    requirements = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [item for item in requirements if item.startswith("transformers")]
    floor = ".".join(compat.MIN_TRANSFORMERS.split(".")[:2])
    ceiling = compat.FIRST_UNSUPPORTED_TRANSFORMERS.split(".")[0]
    assert pin == f"transformers>={floor},<{ceiling}", pin
    setup = (root / "scripts" / "setup.sh").read_text()
    assert (
        re.search(r"^TESTED_TRANSFORMERS=(\S+)$", setup, re.MULTILINE)[1] == compat.NEWEST_TESTED_TRANSFORMERS
    )


def test_the_private_trainer_methods_the_checkpoints_override_take_what_they_are_passed():
    from hf_concept.training.checkpoints import PRIVATE_TRAINER_METHODS, SafeCheckpointsMixin

    for name, parameters in PRIVATE_TRAINER_METHODS.items():
        assert name in vars(SafeCheckpointsMixin), name
        signature = inspect.signature(getattr(Trainer, name))
        assert list(signature.parameters)[1:] == list(parameters), (name, signature)
