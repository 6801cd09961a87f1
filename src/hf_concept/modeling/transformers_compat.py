"""Everything that differs between the transformers releases this remote code supports, in one place.

A checkpoint's code runs under whatever transformers its user has, so the modeling files never test a
version: they speak the newest release's vocabulary and call the helpers below, which translate for the
older releases. Each difference is one name here and one test in `tests/test_transformers_compat.py`:

- the cache's name (`cache` from 5.24, `past_key_values` before; 5.24 keeps the old name with a
  deprecation warning until 5.40): in model outputs (`cache_field`, `output_cache`), in what `forward`
  receives (`take_cache`), in the mask utilities and in the layers whose cache gradient checkpointing
  drops (`cache_kwarg`, `layer_cache`), and in the key lists (`CACHE_KEYS`);
- the name of activation checkpointing (`gradient_checkpointing` before 5.23, `activation_checkpointing`
  from 5.23, the old names deprecated until 6.0): on the model (`enable_activation_checkpointing`,
  `disable_activation_checkpointing`) and in `TrainingArguments` (`checkpointing_arguments`);
- the supported range itself (`check_transformers_version`, run when this module is imported, so a
  release outside the range is named in one line before anything deeper fails).

Differences are detected from the installed transformers (a parameter's name), not from its version
number, where a detection exists; the version is read only to say which release a problem comes from.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import warnings
from typing import Any

import transformers
from packaging.version import Version
from transformers import PreTrainedModel
from transformers.masking_utils import create_causal_mask

# The oldest release the test matrix passes on, and the newest one it ran (`scripts/version_matrix.py`).
MIN_TRANSFORMERS = "5.18.0"
NEWEST_TESTED_TRANSFORMERS = "5.24.0"
# Releases from here on are not expected to work (transformers removes what its deprecations name).
FIRST_UNSUPPORTED_TRANSFORMERS = "6.0.0"

# 5.24 renamed the cache argument of the mask utilities together with generate's and the outputs'.
CACHE_NAME = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"
LEGACY_CACHE_NAME = "past_key_values"
# Set to 1 to import under any release anyway (the version matrix runs the suite below the floor with it,
# to show why the floor is where it is).
IGNORE_RANGE_VARIABLE = "HF_CONCEPT_IGNORE_TRANSFORMERS_RANGE"
# What Trainer's prediction step and accelerate's device placement skip: both names, harmless where
# one of them never occurs.
CACHE_KEYS = ("cache", "past_key_values")


def unsupported_reason(version: str) -> str | None:
    """One line saying why transformers `version` is outside the supported range, or None inside it."""
    installed = Version(version)
    span = f"{MIN_TRANSFORMERS} to {NEWEST_TESTED_TRANSFORMERS}"
    if installed < Version(MIN_TRANSFORMERS):
        return (
            f"this model's code needs transformers>={MIN_TRANSFORMERS} (tested with {span}) and found "
            f"{version}: run pip install 'transformers>={MIN_TRANSFORMERS},<{FIRST_UNSUPPORTED_TRANSFORMERS}'"
        )
    if installed >= Version(FIRST_UNSUPPORTED_TRANSFORMERS):
        return (
            f"this model's code was tested with transformers {span} and found {version}: run pip install "
            f"'transformers<{FIRST_UNSUPPORTED_TRANSFORMERS}', or `hf-concept upgrade FOLDER` with a newer "
            "hf_concept"
        )
    return None


def untested_note(version: str) -> str | None:
    """One line for a release inside the range but newer than the newest tested one, else None."""
    installed = Version(version)
    if Version(NEWEST_TESTED_TRANSFORMERS) < installed < Version(FIRST_UNSUPPORTED_TRANSFORMERS):
        return (
            f"this model's code was tested with transformers {MIN_TRANSFORMERS} to "
            f"{NEWEST_TESTED_TRANSFORMERS} and runs under {version}; if it fails, pip install "
            f"'transformers=={NEWEST_TESTED_TRANSFORMERS}' or run `hf-concept upgrade FOLDER`"
        )
    return None


def check_transformers_version(version: str = transformers.__version__) -> None:
    """Raise ImportError for a release outside the supported range; warn once for an untested newer one."""
    reason = unsupported_reason(version)
    if reason is not None and os.environ.get(IGNORE_RANGE_VARIABLE) != "1":
        raise ImportError(reason)
    note = untested_note(version)
    if note is not None:
        warnings.warn(note, UserWarning, stacklevel=2)


check_transformers_version()


def cache_kwarg(cache: Any) -> dict[str, Any]:
    """The cache as the keyword argument transformers reads it under: the mask utilities size masks from
    it, and gradient checkpointing (`GradientCheckpointingLayer`) drops it from a layer's call so that
    the backward replay does not update it twice."""
    return {CACHE_NAME: cache}


def layer_cache(kwargs: dict[str, Any]) -> Any:
    """The cache a `GradientCheckpointingLayer`'s forward was given (`cache_kwarg`), taken out of `kwargs`."""
    return kwargs.pop(CACHE_NAME, None)


def take_cache(cache: Any, kwargs: dict[str, Any]) -> Any:
    """The cache a `forward` was given: its `cache` argument, or `past_key_values` taken out of `kwargs`.

    `generate` passes `past_key_values` before 5.24 and `cache` from 5.24; a caller's own
    `past_key_values` is accepted under every release, from 5.24 with a FutureWarning like the one
    transformers' own models give.
    """
    if LEGACY_CACHE_NAME not in kwargs:
        return cache
    legacy = kwargs.pop(LEGACY_CACHE_NAME)
    if cache is not None and legacy is not None:
        raise ValueError("pass the cache once: as cache (or as past_key_values), not as both")
    if CACHE_NAME == "cache" and legacy is not None:
        warnings.warn(
            "past_key_values is deprecated since transformers 5.24 and removed in 5.40: pass cache instead",
            FutureWarning,
            stacklevel=3,
        )
    return legacy if cache is None else cache


def cache_field(cls: type) -> type:
    """Make `cls` (a `ModelOutput` subclass that declares `cache: Cache | None = None` or inherits it from
    a class made by this decorator) a dataclass whose cache field has the installed release's name.
    Before 5.24 the field is `past_key_values` (what `generate` reads), the constructor still takes
    `cache=`, and a `cache` property reads the field, so the project writes and reads `cache` under
    every release."""
    if CACHE_NAME == "cache":
        return dataclasses.dataclass(cls)
    # The class's own annotations, in declaration order (dataclass fields follow it).
    annotations = inspect.get_annotations(cls)
    if "cache" in annotations:
        cls.__annotations__ = {
            (CACHE_NAME if name == "cache" else name): kind for name, kind in annotations.items()
        }
        setattr(cls, CACHE_NAME, cls.__dict__["cache"])
        delattr(cls, "cache")
    cls = dataclasses.dataclass(cls)
    if CACHE_NAME not in {field.name for field in dataclasses.fields(cls)}:
        raise TypeError(f"{cls.__name__} has no cache field")
    cls.__init__ = _init_taking_cache(cls.__init__)
    cls.cache = property(lambda output: getattr(output, CACHE_NAME))
    return cls


def _init_taking_cache(init: Any) -> Any:
    """The dataclass `__init__`, taking `cache=` as the older releases' `past_key_values=`."""

    @functools.wraps(init)
    def init_taking_cache(self: Any, *args: Any, **kwargs: Any) -> None:
        if "cache" in kwargs:
            kwargs[CACHE_NAME] = kwargs.pop("cache")
        init(self, *args, **kwargs)

    return init_taking_cache


def output_cache(output: Any) -> Any:
    """The cache of any model output (ours or transformers'), under the installed release's name."""
    return getattr(output, CACHE_NAME, None)


# 5.23 renamed gradient checkpointing to activation checkpointing (model methods and TrainingArguments).
ACTIVATION_CHECKPOINTING = hasattr(PreTrainedModel, "activation_checkpointing_enable")


def enable_activation_checkpointing(model: Any, checkpointing_kwargs: dict[str, Any] | None = None) -> None:
    """`model.activation_checkpointing_enable(...)`, or before 5.23 `gradient_checkpointing_enable(...)`;
    `checkpointing_kwargs` go to `torch.utils.checkpoint` (e.g. `use_reentrant`)."""
    if ACTIVATION_CHECKPOINTING:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpointing_kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing_kwargs)


def disable_activation_checkpointing(model: Any) -> None:
    """`model.activation_checkpointing_disable()`, or before 5.23 `gradient_checkpointing_disable()`."""
    if ACTIVATION_CHECKPOINTING:
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()


def checkpointing_arguments(enabled: bool) -> dict[str, bool]:
    """The `TrainingArguments` keyword that turns activation checkpointing on or off."""
    return {"activation_checkpointing" if ACTIVATION_CHECKPOINTING else "gradient_checkpointing": enabled}
