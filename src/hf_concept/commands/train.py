"""`hf-concept train CONFIG_OR_CHECKPOINT --data FILE... --output-dir DIR`: a thin layer over `Trainer`.

The flags map onto `hf_concept.training.recipes.train` (its module docstring states the choices: data
formats, packing, LoRA targets, μP, LSLM's schedule, the output layout). The same command runs under
`torchrun --nproc_per_node N -m hf_concept.cli train ...` and `accelerate launch -m hf_concept.cli train
...`: Trainer reads the launcher's environment. An input problem found before training starts (missing data
file, unknown text field or model type, a tokenizer that does not fit the model) prints one line to stderr
and exits with status 2; the summary table is printed by the main process only, which then draws the loss
and compression curves into DIR/checkpoints/training_curves.png, beside trainer_state.json
(`hf_concept.training.curves`; needs matplotlib, the `plots` extra: without it one line says that no
picture was drawn). A run that diverges (non-finite loss, gradient norm or weight) prints one line naming
the step and exits with status 1, having saved nothing non-finite; so does a write that fails (a full
disk), after removing what it had half-written. One run at a time per output folder: a second is refused
at once (status 2) with one line naming the run that holds it (`hf_concept.training.output_lock`).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from pathlib import Path


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive integer")
    return value


def _max_steps(text: str) -> int:
    value = int(text)
    if value < 1 and value != -1:
        raise argparse.ArgumentTypeError(
            f"{text!r} must be a positive number of optimizer steps, or -1 to train for --num-train-epochs"
        )
    return value


def _report_to(text: str) -> str | list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    return "none" if names in ([], ["none"]) else names


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train",
        help="Train or fine-tune a model (config or checkpoint) on local text with Trainer.",
        description="Train a model built from a config (file, or folder without weights) or fine-tune a "
        "checkpoint on local .txt/.json/.jsonl/.parquet files or a datasets folder, logging lm_loss, "
        "aux_loss and the realised compression; save the final model, tokenizer and model card to "
        "--output-dir.",
    )
    parser.add_argument("model", type=Path, metavar="CONFIG_OR_CHECKPOINT")
    _add_data_flags(parser)
    _add_model_flags(parser)
    _add_trainer_flags(parser)


def _add_data_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data", nargs="+", type=Path, required=True, help="Training files or datasets folders."
    )
    parser.add_argument("--eval-data", nargs="+", type=Path, default=None, help="Evaluation files.")
    parser.add_argument(
        "--data-split",
        default=None,
        metavar="NAME",
        help="Split of a saved DatasetDict given to --data (default: train).",
    )
    parser.add_argument(
        "--eval-data-split",
        default=None,
        metavar="NAME",
        help="Split of a saved DatasetDict given to --eval-data (default: train), e.g. validation.",
    )
    parser.add_argument(
        "--data-filter",
        action="append",
        default=[],
        metavar="COLUMN=VALUE[,VALUE]",
        help="Keep rows whose COLUMN holds a VALUE, e.g. language=en (repeatable; eval data too).",
    )
    parser.add_argument(
        "--streaming",
        action="store_true",
        help="Read the data lazily as a datasets IterableDataset (larger than memory; needs --max-steps).",
    )
    parser.add_argument(
        "--eval-split-fraction", type=float, default=None, help="Hold out this share of documents."
    )
    parser.add_argument("--text-field", default="text", help="Text field of JSON records / dataset column.")
    parser.add_argument(
        "--txt-documents",
        choices=("paragraph", "file"),
        default="paragraph",
        help="A .txt document is a blank-line-separated paragraph (default) or the whole file.",
    )
    parser.add_argument("--tokenizer", type=Path, default=None, help="Tokenizer folder (default: see docs).")
    parser.add_argument(
        "--block-size",
        type=_positive_int,
        default=None,
        help="Longest training sequence (default: 512, or the model's max_position_embeddings if smaller).",
    )
    parser.add_argument("--no-packing", action="store_true", help="Pad batches instead of packing them.")
    parser.add_argument(
        "--encoding-errors",
        choices=("strict", "replace"),
        default="strict",
        help="Bytes of a data file that are not UTF-8: an error naming file and offset (default), or "
        "read as U+FFFD (replace).",
    )


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lora", action="store_true", help="Train LoRA adapters (merged when saving).")
    parser.add_argument("--lora-r", type=_positive_int, default=8)
    parser.add_argument("--lora-alpha", type=float, default=16.0)
    parser.add_argument("--lora-dropout", type=float, default=0.0)
    parser.add_argument(
        "--mup",
        action="store_true",
        help="DLCM μP param groups (automatic when the config sets mup_base_width).",
    )
    parser.add_argument(
        "--hold-ratio",
        action="store_true",
        help="ConceptMoE: hold the realised tokens per concept at compression_ratio by recalibrating the "
        "router's threshold after every step (for a converted checkpoint, whose router otherwise gives up "
        "compression).",
    )
    parser.add_argument("--base-model", default=None, help="Name of the starting model in the model card.")
    parser.add_argument(
        "--gguf-file", default=None, metavar="NAME", help="The .gguf file to start from in a folder of many."
    )


def _add_trainer_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--output-dir",
        type=Path,
        required=True,
        help="Where the model and checkpoints go. One run at a time: a second run into the same folder is "
        "refused, naming the one that holds it.",
    )
    parser.add_argument(
        "--overwrite-output-dir",
        action="store_true",
        help="Start again from step 0 in a non-empty --output-dir (its earlier checkpoints are removed).",
    )
    resume = parser.add_mutually_exclusive_group()
    resume.add_argument(
        "--resume",
        action="store_true",
        help="Continue from the newest complete checkpoint in --output-dir/checkpoints (incomplete ones, "
        "e.g. from a run killed while saving, are skipped with a warning). A folder that holds a saved model "
        "but no complete checkpoint (--save-steps 0) is refused rather than overwritten.",
    )
    resume.add_argument(
        "--resume-from",
        type=Path,
        default=None,
        metavar="PATH",
        help="Continue from this checkpoint; refused when it was saved by another config, family, size or "
        "LoRA setting, or holds NaN/inf weights.",
    )
    parser.add_argument(
        "--resume-changed-settings",
        action="store_true",
        help="With --resume or --resume-from: continue even though the checkpoint was written with other "
        "--data (contents), --per-device-train-batch-size, --gradient-accumulation-steps or world size "
        "(otherwise refused, exit 2); each change is named.",
    )
    parser.add_argument(
        "--max-steps",
        type=_max_steps,
        default=-1,
        help="Total optimizer steps (overrides epochs; -1: use epochs). When resuming it counts from step 0: "
        "a target below the checkpoint's step is refused (exit 2); equal to it trains nothing and only saves "
        "the checkpoint's model, saying so.",
    )
    parser.add_argument("--num-train-epochs", type=float, default=1.0)
    parser.add_argument("--per-device-train-batch-size", type=_positive_int, default=8)
    parser.add_argument("--gradient-accumulation-steps", type=_positive_int, default=1)
    parser.add_argument("--learning-rate", type=float, default=None, help="Default 3e-4 (μP: the config's).")
    parser.add_argument("--warmup-steps", type=int, default=0)
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--logging-steps", type=_positive_int, default=10)
    parser.add_argument("--save-steps", type=int, default=500, help="Checkpoint interval; 0 saves none.")
    parser.add_argument("--eval-steps", type=_positive_int, default=None, help="Also evaluate every N steps.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--report-to", type=_report_to, default="none", help="e.g. tensorboard,wandb.")
    parser.add_argument(
        "--callback",
        action="append",
        default=[],
        metavar="MODULE:CLASS",
        help="Extra TrainerCallback, built with no arguments (repeatable).",
    )
    parser.add_argument("--use-cpu", action="store_true", help="Train on the CPU even if a GPU is present.")


def run(args: argparse.Namespace) -> int:
    from hf_concept.conversion.gguf_source import source_folder

    with contextlib.ExitStack() as stack:
        try:
            # A GGUF checkpoint is de-quantised into a temporary folder that lives until training ends.
            source = stack.enter_context(source_folder(args.model, args.gguf_file))
        except ValueError as error:
            print(f"hf-concept train: error: {error}", file=sys.stderr)
            return 2
        if source.gguf is not None:
            args.model, args.base_model = source.folder, args.base_model or str(source.gguf)
        return _train(args)


def _train(args: argparse.Namespace) -> int:
    from hf_concept.training.errors import OutputWriteError, TrainingDivergedError, TrainSetupError
    from hf_concept.training.recipes import train

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("hf-concept train: %(message)s"))
    logger = logging.getLogger("hf_concept.train")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        result = train(
            args.model,
            args.data,
            args.output_dir,
            tokenizer=args.tokenizer,
            eval_data=args.eval_data,
            eval_split_fraction=args.eval_split_fraction,
            text_field=args.text_field,
            txt_documents=args.txt_documents,
            block_size=args.block_size,
            packing=not args.no_packing,
            lora=args.lora,
            lora_r=args.lora_r,
            lora_alpha=args.lora_alpha,
            lora_dropout=args.lora_dropout,
            mup=True if args.mup else None,
            max_steps=args.max_steps,
            num_train_epochs=args.num_train_epochs,
            per_device_train_batch_size=args.per_device_train_batch_size,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            learning_rate=args.learning_rate,
            warmup_steps=args.warmup_steps,
            weight_decay=args.weight_decay,
            logging_steps=args.logging_steps,
            save_steps=args.save_steps,
            eval_steps=args.eval_steps,
            seed=args.seed,
            bf16=args.bf16,
            gradient_checkpointing=args.gradient_checkpointing,
            report_to=args.report_to,
            callbacks=args.callback,
            overwrite_output_dir=args.overwrite_output_dir,
            base_model=args.base_model,
            use_cpu=args.use_cpu,
            resume=args.resume,
            resume_from=args.resume_from,
            resume_changed_settings=args.resume_changed_settings,
            encoding_errors=args.encoding_errors,
            data_split=args.data_split,
            eval_data_split=args.eval_data_split,
            data_filter=args.data_filter,
            streaming=args.streaming,
            hold_ratio=args.hold_ratio,
        )
        if result.is_main_process:
            print(result.summary_table())
            _draw_curves(result.log_history, args.output_dir)
    except TrainSetupError as error:
        print(f"hf-concept train: error: {error}", file=sys.stderr)
        return 2
    except (TrainingDivergedError, OutputWriteError) as error:
        print(f"hf-concept train: error: {error}", file=sys.stderr)
        return 1
    except OSError as error:
        print(f"hf-concept train: error: {_os_error_line(error, args.output_dir)}", file=sys.stderr)
        return 1
    finally:
        logger.removeHandler(handler)
    return 0


def _os_error_line(error: OSError, output_dir: Path) -> str:
    """An OSError the library did not word itself (Trainer's own files, a file read): for a write into
    the output folder the cause and what to do, else the file and the cause."""
    from hf_concept.training.errors import failed_write_line

    line = failed_write_line(error, output_dir, "--output-dir")
    if line is None:
        line = f"{error.filename}: {(error.strerror or str(error)).lower()}" if error.filename else str(error)
    return line


def _draw_curves(log_history: list[dict], output_dir: Path) -> None:
    """The run's curves beside trainer_state.json; a picture that cannot be written does not fail the run."""
    from hf_concept.training.curves import CURVES_NAME, write_training_curves
    from hf_concept.training.recipes import CHECKPOINTS_NAME

    path = output_dir / CHECKPOINTS_NAME / CURVES_NAME
    try:
        written = write_training_curves(log_history, path)
    except OSError as error:
        logging.getLogger("hf_concept.train").warning(f"training curves not drawn ({path}): {error}")
        return
    if written is not None:
        print(f"training curves: {written}")
