"""`train`'s options, declared once: `TrainOptions` is the recipe's keyword arguments, the command line of
`hf-concept train` (`add_option_arguments`) and, for fields marked `trainer=True`, `TrainingArguments`
fields passed on by name (`trainer_fields`).

Adding an option is one field here: `option(default, help, ...)`. Its flag is `--the-field-name` unless
`flag` names another; a bool with default False is a switch; `cli` holds any further `add_argument`
keywords (a `type` that validates, `choices`, `nargs`, `action`). A field with `python_only=True` has no
flag (`disable_tqdm`). `group` orders the help: data, then model, then trainer options.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GROUPS = ("data", "model", "trainer")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive integer")
    return value


def max_steps_value(text: str) -> int:
    value = int(text)
    if value < 1 and value != -1:
        raise argparse.ArgumentTypeError(
            f"{text!r} must be a positive number of optimizer steps, or -1 to train for --num-train-epochs"
        )
    return value


def report_to_value(text: str) -> str | list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    return "none" if names in ([], ["none"]) else names


def option(
    default: Any = dataclasses.MISSING,
    help: str | None = None,
    *,
    group: str = "trainer",
    trainer: bool = False,
    flag: str | None = None,
    cli: dict[str, Any] | None = None,
    python_only: bool = False,
    factory: Any = dataclasses.MISSING,
) -> dataclasses.Field:
    """A `TrainOptions` field: its default (or `factory`), help and command-line form (module docstring);
    `trainer=True` passes it to `TrainingArguments` under its own name."""
    metadata = {
        "help": help,
        "group": group,
        "trainer": trainer,
        "flag": flag,
        "cli": cli or {},
        "python_only": python_only,
    }
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class TrainOptions:
    """Every option of `hf_concept.training.recipes.train` and of `hf-concept train`."""

    # Required: the flags `--data` and `--output-dir`, the recipe's second and third positional arguments.
    data: Any = option(
        group="data",
        help="Training files or datasets folders.",
        cli={"nargs": "+", "type": Path, "required": True},
    )
    output_dir: Any = option(
        help="Where the model and checkpoints go. One run at a time: a second run into the same folder is "
        "refused, naming the one that holds it.",
        cli={"type": Path, "required": True},
    )
    eval_data: Any = option(None, "Evaluation files.", group="data", cli={"nargs": "+", "type": Path})
    data_split: str | None = option(
        None,
        "Split of a saved DatasetDict given to --data (default: train).",
        group="data",
        cli={"metavar": "NAME"},
    )
    eval_data_split: str | None = option(
        None,
        "Split of a saved DatasetDict given to --eval-data (default: train), e.g. validation.",
        group="data",
        cli={"metavar": "NAME"},
    )
    data_filter: Sequence[str] = option(
        help="Keep rows whose COLUMN holds a VALUE, e.g. language=en (repeatable; eval data too).",
        group="data",
        cli={"action": "append", "metavar": "COLUMN=VALUE[,VALUE]"},
        factory=list,
    )
    streaming: bool = option(
        False,
        "Read the data lazily as a datasets IterableDataset (larger than memory; needs --max-steps).",
        group="data",
    )
    eval_split_fraction: float | None = option(
        None, "Hold out this share of documents.", group="data", cli={"type": float}
    )
    text_field: str = option("text", "Text field of JSON records / dataset column.", group="data")
    txt_documents: str = option(
        "paragraph",
        "A .txt document is a blank-line-separated paragraph (default) or the whole file.",
        group="data",
        cli={"choices": ("paragraph", "file")},
    )
    # A folder on the command line; the recipe also takes a tokenizer object.
    tokenizer: Any = option(None, "Tokenizer folder (default: see docs).", group="data", cli={"type": Path})
    block_size: int | None = option(
        None,
        "Longest training sequence (default: 512, or the model's max_position_embeddings if smaller).",
        group="data",
        cli={"type": positive_int},
    )
    packing: bool = option(
        True,
        "Pad batches instead of packing them.",
        group="data",
        flag="--no-packing",
        cli={"action": "store_false"},
    )
    encoding_errors: str = option(
        "strict",
        "Bytes of a data file that are not UTF-8: an error naming file and offset (default), or read as "
        "U+FFFD (replace).",
        group="data",
        cli={"choices": ("strict", "replace")},
    )
    lora: bool = option(False, "Train LoRA adapters (merged when saving).", group="model")
    lora_r: int = option(8, group="model", cli={"type": positive_int})
    lora_alpha: float = option(16.0, group="model", cli={"type": float})
    lora_dropout: float = option(0.0, group="model", cli={"type": float})
    mup: bool | None = option(
        None,
        "DLCM μP param groups (automatic when the config sets mup_base_width).",
        group="model",
        cli={"action": "store_const", "const": True},
    )
    hold_ratio: bool = option(
        False,
        "ConceptMoE: hold the realised tokens per concept at compression_ratio by recalibrating the router's "
        "threshold after every step (for a converted checkpoint, whose router otherwise gives up "
        "compression).",
        group="model",
    )
    base_model: str | None = option(None, "Name of the starting model in the model card.", group="model")
    distill_from: Any = option(
        None,
        "The source model (a folder) that teaches the converted one: its next-token distribution is "
        "added to the loss as KL(source || model) at every label position (training.distillation). Its "
        "tokenizer must be the model's.",
        group="model",
        cli={"type": Path, "metavar": "SOURCE"},
    )
    distill_temperature: float = option(
        1.0,
        "Temperature of both distributions in the --distill-from KL term.",
        group="model",
        cli={"type": float},
    )
    align_hidden: float = option(
        0.0,
        "With --distill-from: weight of the alignment of the last token states with the source's "
        "(1 - cosine); 0 leaves it out.",
        group="model",
        cli={"type": float},
    )
    overwrite_output_dir: bool = option(
        False, "Start again from step 0 in a non-empty --output-dir (its earlier checkpoints are removed)."
    )
    resume: bool = option(
        False,
        "Continue from the newest complete checkpoint in --output-dir/checkpoints (incomplete ones, e.g. "
        "from a run killed while saving, are skipped with a warning). A folder that holds a saved model but "
        "no complete checkpoint (--save-steps 0) is refused rather than overwritten.",
        cli={"exclusive": "resume"},
    )
    resume_from: Any = option(
        None,
        "Continue from this checkpoint; refused when it was saved by another config, family, size or LoRA "
        "setting, or holds NaN/inf weights.",
        cli={"exclusive": "resume", "type": Path, "metavar": "PATH"},
    )
    resume_changed_settings: bool = option(
        False,
        "With --resume or --resume-from: continue even though the checkpoint was written with other --data "
        "(contents), --per-device-train-batch-size, --gradient-accumulation-steps or world size (otherwise "
        "refused, exit 2); each change is named.",
    )
    max_steps: int = option(
        -1,
        "Total optimizer steps (overrides epochs; -1: use epochs). When resuming it counts from step 0: a "
        "target below the checkpoint's step is refused (exit 2); equal to it trains nothing and only saves "
        "the checkpoint's model, saying so.",
        trainer=True,
        cli={"type": max_steps_value},
    )
    num_train_epochs: float = option(1.0, trainer=True, cli={"type": float})
    per_device_train_batch_size: int = option(8, trainer=True, cli={"type": positive_int})
    gradient_accumulation_steps: int = option(1, trainer=True, cli={"type": positive_int})
    learning_rate: float | None = option(None, "Default 3e-4 (μP: the config's).", cli={"type": float})
    warmup_steps: int = option(0, trainer=True, cli={"type": int})
    weight_decay: float = option(0.0, trainer=True, cli={"type": float})
    logging_steps: int = option(10, trainer=True, cli={"type": positive_int})
    save_steps: int = option(500, "Checkpoint interval; 0 saves none.", cli={"type": int})
    eval_steps: int | None = option(None, "Also evaluate every N steps.", cli={"type": positive_int})
    seed: int = option(0, trainer=True, cli={"type": int})
    bf16: bool = option(False, trainer=True)
    gradient_checkpointing: bool = option(False)
    report_to: str | list[str] = option(
        "none", "e.g. tensorboard,wandb.", trainer=True, cli={"type": report_to_value}
    )
    callbacks: Sequence[Any] = option(
        help="Extra TrainerCallback, built with no arguments (repeatable).",
        flag="--callback",
        cli={"action": "append", "metavar": "MODULE:CLASS"},
        factory=list,
    )
    use_cpu: bool = option(False, "Train on the CPU even if a GPU is present.")
    disable_tqdm: bool | None = option(None, trainer=True, python_only=True)


def trainer_fields(options: TrainOptions) -> dict[str, Any]:
    """The fields marked `trainer=True`, by name: what `TrainingArguments` takes as it is."""
    return {
        item.name: getattr(options, item.name)
        for item in dataclasses.fields(options)
        if item.metadata.get("trainer")
    }


def _command_line_fields(options_class: type) -> list[dataclasses.Field]:
    fields = [item for item in dataclasses.fields(options_class) if not item.metadata.get("python_only")]
    return sorted(fields, key=lambda item: GROUPS.index(item.metadata.get("group", "trainer")))


def add_option_arguments(parser: argparse.ArgumentParser, options_class: type = TrainOptions) -> None:
    """One flag per field of `options_class` (module docstring), in group order; `dest` is the field."""
    hints = typing.get_type_hints(options_class)
    exclusive: dict[str, Any] = {}
    for item in _command_line_fields(options_class):
        keywords = dict(item.metadata.get("cli") or {})
        target = parser
        if "exclusive" in keywords:
            name = keywords.pop("exclusive")
            if name not in exclusive:
                exclusive[name] = parser.add_mutually_exclusive_group()
            target = exclusive[name]
        if item.metadata.get("help"):
            keywords["help"] = item.metadata["help"]
        if hints[item.name] is bool and "action" not in keywords:
            keywords["action"] = "store_true"
        if not keywords.get("required"):
            keywords["default"] = (
                item.default_factory() if item.default_factory is not dataclasses.MISSING else item.default
            )
        flag = item.metadata.get("flag") or "--" + item.name.replace("_", "-")
        target.add_argument(flag, dest=item.name, **keywords)


def options_from_arguments(arguments: argparse.Namespace, options_class: type = TrainOptions) -> TrainOptions:
    """The `options_class` instance of parsed command-line `arguments` (Python-only fields at defaults)."""
    names = [item.name for item in _command_line_fields(options_class)]
    return options_class(**{name: getattr(arguments, name) for name in names})
