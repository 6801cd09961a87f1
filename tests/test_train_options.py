"""`train`'s options are declared once (`hf_concept.training.options.TrainOptions`): the command line, the
recipe's keyword arguments and the `TrainingArguments` fields all come from the one declaration."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import pytest

from hf_concept.training.options import TrainOptions, add_option_arguments, option, options_from_arguments
from hf_concept.training.recipes import train, training_arguments

# The flags `hf-concept train` had before its options were declared in one place: none may go.
FLAGS = [
    "--data",
    "--eval-data",
    "--data-split",
    "--eval-data-split",
    "--data-filter",
    "--streaming",
    "--eval-split-fraction",
    "--text-field",
    "--txt-documents",
    "--tokenizer",
    "--block-size",
    "--no-packing",
    "--encoding-errors",
    "--lora",
    "--lora-r",
    "--lora-alpha",
    "--lora-dropout",
    "--mup",
    "--hold-ratio",
    "--base-model",
    "--output-dir",
    "--overwrite-output-dir",
    "--resume",
    "--resume-from",
    "--resume-changed-settings",
    "--max-steps",
    "--num-train-epochs",
    "--per-device-train-batch-size",
    "--gradient-accumulation-steps",
    "--learning-rate",
    "--warmup-steps",
    "--weight-decay",
    "--logging-steps",
    "--save-steps",
    "--eval-steps",
    "--seed",
    "--bf16",
    "--gradient-checkpointing",
    "--report-to",
    "--callback",
    "--use-cpu",
]


def parser_of(options_class: type) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_option_arguments(parser, options_class)
    return parser


def parse(options_class: type, *argv: str) -> TrainOptions:
    arguments = parser_of(options_class).parse_args(["--data", "a.txt", "--output-dir", "out", *argv])
    return options_from_arguments(arguments, options_class)


@dataclass
class WithBeta(TrainOptions):
    """One option more, written as the module docstring says, and nothing else."""

    adam_beta2: float = option(0.999, "AdamW's beta2.", trainer=True, cli={"type": float})


def test_an_added_option_reaches_the_command_line_and_training_arguments(tmp_path):
    assert parse(WithBeta).adam_beta2 == 0.999
    options = parse(WithBeta, "--adam-beta2", "0.95", "--max-steps", "3")
    assert options.adam_beta2 == 0.95 and options.max_steps == 3
    arguments = training_arguments(tmp_path, options, has_eval=False)
    assert arguments.adam_beta2 == 0.95 and arguments.max_steps == 3
    # The base declaration is untouched.
    assert "adam_beta2" not in {item.name for item in dataclasses.fields(TrainOptions)}


def test_every_flag_is_kept_and_defaults_match_the_declaration():
    parser = parser_of(TrainOptions)
    flags = {flag for action in parser._actions for flag in action.option_strings}
    assert set(FLAGS) <= flags
    parsed = parse(TrainOptions)
    for item in dataclasses.fields(TrainOptions):
        if item.name in ("data", "output_dir") or item.metadata.get("python_only"):
            continue
        default = item.default_factory() if item.default_factory is not dataclasses.MISSING else item.default
        assert getattr(parsed, item.name) == default, item.name
    assert parsed.data == [Path("a.txt")] and parsed.packing is True and parsed.mup is None


def test_command_line_forms():
    options = parse(
        TrainOptions,
        *("--no-packing", "--mup", "--callback", "a:B", "--callback", "c:D", "--data-filter", "language=en"),
        *("--report-to", "tensorboard,wandb", "--resume-from", "ckpt"),
    )
    assert options.packing is False and options.mup is True
    assert options.callbacks == ["a:B", "c:D"] and options.data_filter == ["language=en"]
    assert options.report_to == ["tensorboard", "wandb"] and options.resume_from == Path("ckpt")
    with pytest.raises(SystemExit):
        parse(TrainOptions, "--resume", "--resume-from", "ckpt")
    with pytest.raises(SystemExit):
        parse(TrainOptions, "--lora-r", "0")


def test_the_recipe_refuses_an_unknown_option_by_name(tmp_path):
    with pytest.raises(TypeError, match="no_such_option"):
        train("config.json", tmp_path / "a.txt", tmp_path / "out", no_such_option=1)
    assert not (tmp_path / "out").exists()
