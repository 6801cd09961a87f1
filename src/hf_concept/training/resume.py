"""Whether a complete checkpoint can continue this run, checked before Trainer loads it.

Trainer's own loading accepts a checkpoint of another config with the same shapes (a ratio-2 ConceptMoE
into a ratio-4 run trains on silently), fails deep in `load_state_dict` or the optimizer for another
family, size or LoRA setting, and a step target at or below the checkpoint's step still runs one step.
`check_resume` refuses each of these with one line naming the checkpoint and what differs:

- the step target: `max_steps` below the checkpoint's global step is refused (Trainer would run one more
  step past it); equal to it trains nothing (no step at all: `restore_without_training`) and only saves
  the checkpoint's model, with a warning that says so (`--max-steps -1`, epochs, is left to Trainer);
- full weights against a LoRA run, or a LoRA adapter against a full run;
- the saved config (`config.json`, when the checkpoint has one): every field that changes the
  computation must be equal; `NOT_COMPUTATIONAL` lists those that do not (bookkeeping, output switches);
- the weights' names and shapes (from the safetensors headers, nothing loaded): none may be unknown to
  the model or have another shape;
- every tensor must be finite (read one at a time): training on from NaN or inf cannot work, and would
  otherwise be reported as a divergence blamed on the learning rate.

The run's data, batch size, accumulation steps and world size are compared with those the checkpoint
records by `hf_concept.training.run_settings.check_run_settings`, once Trainer's arguments are known.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from hf_concept.safetensors_check import safetensors_header
from hf_concept.training.checkpoints import weight_files
from hf_concept.training.errors import TrainSetupError

logger = logging.getLogger("hf_concept.train")

ADAPTER_WEIGHTS = "adapter_model.safetensors"
# Config fields that record where a model came from or what it returns, not what it computes.
NOT_COMPUTATIONAL = frozenset(
    {
        "_name_or_path",
        "architectures",
        "auto_map",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "id2label",
        "label2id",
        "problem_type",
        "tokenizer_class",
        "chunk_size_feed_forward",
    }
)
# At most this many names in a message.
SHOWN = 3


def checkpoint_step(checkpoint: Path) -> int:
    """The global step a complete checkpoint was saved at (its trainer_state.json)."""
    return int(json.loads((checkpoint / "trainer_state.json").read_text())["global_step"])


def _listed(names: list[str]) -> str:
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


def check_resume_target(checkpoint: Path, max_steps: int) -> bool:
    """Refuse a step target below the checkpoint's step; True when it is the checkpoint's step, after
    saying that nothing is left to train (the run then only saves the checkpoint's model, see
    `restore_without_training`: how a run killed while saving its final model is finished)."""
    step = checkpoint_step(checkpoint)
    if max_steps == -1 or max_steps > step:
        return False
    if max_steps == step:
        logger.warning(
            f"--max-steps {max_steps}: {checkpoint} is already at step {step}, nothing is left to train; "
            "saving its model (give a larger --max-steps to train on)"
        )
        return True
    raise TrainSetupError(
        f"--max-steps {max_steps} is below the step of {checkpoint} ({step}): that run is already past it; "
        f"give --max-steps {step} to only save its model, or above {step} to train on from it"
    )


def restore_without_training(trainer: Any, checkpoint: Path) -> None:
    """Give `trainer` the checkpoint's weights and state without a step. (`Trainer.train` resumed at its
    step target would still run one more optimizer step.)"""
    from transformers import TrainerState

    trainer._load_from_checkpoint(str(checkpoint))
    trainer.state = TrainerState.load_from_json(str(checkpoint / "trainer_state.json"))


def check_resume(model: Any, checkpoint: Path, lora: bool) -> None:
    """Refuse a checkpoint that does not fit `model` (already LoRA-wrapped when `lora`), or holds
    non-finite weights (see the module docstring)."""
    has_adapter = (checkpoint / ADAPTER_WEIGHTS).is_file()
    if lora and not has_adapter:
        raise TrainSetupError(
            f"{checkpoint} holds full-model weights, but --lora trains adapters: resume it without --lora, "
            "or start the LoRA run in another --output-dir"
        )
    if has_adapter and not lora:
        raise TrainSetupError(
            f"{checkpoint} holds a LoRA adapter: resume it with --lora (and its --lora-r), or start a full "
            "run in another --output-dir"
        )
    base = model.get_base_model() if lora else model
    differences = config_differences(base.config, checkpoint)
    if differences:
        raise TrainSetupError(
            f"{checkpoint} was saved by a model with another config ({_listed(differences)}): resume "
            "with the model or config that wrote it, or start this run in another --output-dir"
        )
    problems = shape_problems(model, checkpoint, lora)
    if problems:
        raise TrainSetupError(
            f"{checkpoint} does not fit this model ({_listed(problems)}): resume with the model or "
            "config that wrote it, or start this run in another --output-dir"
        )
    bad, count = non_finite_tensors(checkpoint)
    if count:
        raise TrainSetupError(
            f"{checkpoint} holds NaN or inf in {count} tensor(s) ({_listed(bad)}): training cannot go on "
            "from it; resume from an earlier checkpoint (--resume-from PATH) or start again"
        )


def _full_config(config_class: type, values: dict[str, Any]) -> dict[str, Any]:
    """Every field of a config as `config_class` reads `values` (saved files may omit defaults)."""
    return config_class.from_dict(values).to_dict()


def config_differences(config: Any, checkpoint: Path) -> list[str]:
    """One "field: checkpoint A, this run B" per computational field where the checkpoint's saved
    config.json differs from `config`; empty when it has none (a LoRA checkpoint)."""
    path = checkpoint / "config.json"
    if not path.is_file():
        return []
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        return [f"config.json unreadable ({error})"]
    if not isinstance(saved, dict):
        return ["config.json is not a JSON object"]
    if saved.get("model_type") != config.model_type:
        return [f"model_type: checkpoint {saved.get('model_type')!r}, this run {config.model_type!r}"]
    try:
        theirs = _full_config(type(config), saved)
    except (ValueError, TypeError) as error:
        return [f"config.json does not load ({error})"]
    ours = _full_config(type(config), config.to_dict())
    fields = sorted((set(theirs) | set(ours)) - NOT_COMPUTATIONAL)
    return [
        f"{field}: checkpoint {theirs.get(field)!r}, this run {ours.get(field)!r}"
        for field in fields
        if theirs.get(field) != ours.get(field)
    ]


def _expected_shapes(model: Any, lora: bool) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the tensors a checkpoint of `model` holds (PEFT's adapter names for LoRA)."""
    if lora:
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(model)
    else:
        state = model.state_dict()
    return {name: tuple(tensor.shape) for name, tensor in state.items()}


def shape_problems(model: Any, checkpoint: Path, lora: bool) -> list[str]:
    """Tensors of the checkpoint the model does not have, and those with another shape. (A checkpoint
    may lack tensors the model has: tied weights are saved once.)"""
    expected = _expected_shapes(model, lora)
    unknown, reshaped = [], []
    for path in weight_files(checkpoint):
        _, header = safetensors_header(path)
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            if name not in expected:
                unknown.append(name)
            elif tuple(entry["shape"]) != expected[name]:
                reshaped.append(f"{name} {tuple(entry['shape'])} vs {expected[name]}")
    problems = []
    if unknown:
        problems.append(f"{len(unknown)} tensor(s) this model does not have, e.g. {unknown[0]}")
    return problems + [f"shape of {item}" for item in reshaped]


def non_finite_tensors(checkpoint: Path, limit: int = SHOWN) -> tuple[list[str], int]:
    """(up to `limit` "file: tensor" names, the count) of the checkpoint's tensors holding NaN or inf."""
    from safetensors import safe_open

    names, count = [], 0
    for path in weight_files(checkpoint):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensor = handle.get_tensor(name)
                if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                    count += 1
                    if len(names) < limit:
                        names.append(f"{path.name}: {name}")
    return names, count
