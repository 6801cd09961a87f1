"""`hf-concept train CONFIG_OR_CHECKPOINT --data FILE... --output-dir DIR`: a thin layer over `Trainer`.

The flags are the fields of `hf_concept.training.options.TrainOptions`, declared once, read by
`hf_concept.training.recipes.train` (its module docstring states the choices: data formats, packing, LoRA
targets, μP, LSLM's schedule, the output layout). The same command runs under
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


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from hf_concept.training.options import add_option_arguments

    parser = subparsers.add_parser(
        "train",
        help="Train or fine-tune a model (config or checkpoint) on local text with Trainer.",
        description="Train a model built from a config (file, or folder without weights) or fine-tune a "
        "checkpoint on local .txt/.json/.jsonl/.parquet files or a datasets folder, logging lm_loss, "
        "aux_loss and the realised compression; save the final model, tokenizer and model card to "
        "--output-dir.",
    )
    parser.add_argument("model", type=Path, metavar="CONFIG_OR_CHECKPOINT")
    # Every option of the recipe, declared once (`hf_concept.training.options.TrainOptions`).
    add_option_arguments(parser)
    parser.add_argument(
        "--gguf-file", default=None, metavar="NAME", help="The .gguf file to start from in a folder of many."
    )


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
    from hf_concept.training.options import options_from_arguments
    from hf_concept.training.recipes import train_with

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("hf-concept train: %(message)s"))
    logger = logging.getLogger("hf_concept.train")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        result = train_with(args.model, options_from_arguments(args))
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
    _end_process_group()
    return 0


def _end_process_group() -> None:
    """Under torchrun, tear down the process group Trainer set up once training has ended on every rank.

    Left to interpreter exit, gloo's worker threads can still hold tensors while Python is finalised, and
    the process aborts ("terminate called without an active exception", SIGABRT) after a run that
    succeeded. Only a run that ended cleanly does this: a rank that failed may leave others inside a
    collective, where tearing down is the launcher's job."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


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
