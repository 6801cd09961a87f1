"""The end of a `train` run: gather the figures, save the (merged) model with its tokenizer and model card
into the output folder atomically (staging folder, then moved into place with config.json last)."""

from __future__ import annotations

import inspect
import json
import logging
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import PreTrainedModel

from hf_concept.tables import format_table
from hf_concept.training.errors import (
    OutputWriteError,
    is_write_failure,
    write_failure_cause,
    write_failure_hint,
)

if TYPE_CHECKING:
    from hf_concept.training.recipe_trainer import RecipeTrainer

logger = logging.getLogger("hf_concept.train")

STAGING_NAME = ".final-staging"


@dataclass
class TrainResult:
    """What `train` returns: the trained (merged) model in memory, its tokenizer and the figures."""

    output_dir: Path
    model: PreTrainedModel
    tokenizer: Any
    log_history: list[dict[str, Any]]
    global_step: int
    train_loss: float | None
    eval_loss: float | None
    compression: float | None
    is_main_process: bool = True
    card_path: Path | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    # Why `compression` is None, for the table: a short run that never logged, or a family without concepts.
    compression_note: str | None = None
    # The rate training samples boundaries at (ConceptMoE/DLCM's learned router), beside the headline.
    sampled_compression: float | None = None

    def summary_table(self) -> str:
        """The end-of-run table: final training loss, eval loss, realised compression, steps, output."""

        def figure(value: float | None) -> str:
            return "n/a" if value is None else f"{value:.4f}"

        rows = [
            ("final train loss", figure(self.train_loss)),
            ("eval loss", figure(self.eval_loss)),
            ("compression at inference (tokens per concept)", self._compression_figure()),
            ("compression sampled in training", figure(self.sampled_compression)),
            ("optimizer steps", str(self.global_step)),
            ("saved to", str(self.output_dir)),
        ]
        # A rule of fixed length under the values, however long they are (the output path may be).
        width = max(len(name) for name, _ in rows)
        return format_table(("metric", "value"), rows, widths=(width, 12), sep=" | ", rule="line")

    def _compression_figure(self) -> str:
        if self.compression is not None:
            return f"{self.compression:.4f}"
        return f"n/a ({self.compression_note})" if self.compression_note else "n/a"


def _last_logged(log_history: list[dict[str, Any]], key: str) -> float | None:
    for entry in reversed(log_history):
        if key in entry:
            return float(entry[key])
    return None


def _final_train_loss(log_history: list[dict[str, Any]]) -> float | None:
    """The last logged loss; without any log in the run, the run's mean ("train_loss")."""
    loss = _last_logged(log_history, "loss")
    return loss if loss is not None else _last_logged(log_history, "train_loss")


def _inference_compression(eval_metrics: dict[str, float], log_history: list[dict[str, Any]]) -> float | None:
    """The headline ratio is the one generation realises: the evaluation's (inference mode), else the
    last logged inference ratio of training, else (families without one) the last logged ratio."""
    if "eval_compression_ratio" in eval_metrics:
        return eval_metrics["eval_compression_ratio"]
    inferred = _last_logged(log_history, "inference_compression_ratio")
    if inferred is not None:
        return inferred
    # LSLM logs the fraction of bytes its inference rule ends a segment at: bytes per segment is 1 / it.
    rate = _last_logged(log_history, "inference_boundary_rate")
    if rate is not None and rate > 0:
        return 1.0 / rate
    return _last_logged(log_history, "compression_ratio")


def _sampled_compression(eval_metrics: dict[str, float], log_history: list[dict[str, Any]]) -> float | None:
    """The rate training samples at, next to the headline: the evaluation's expected sampled ratio, else
    the last ratio training logged (its boundaries were sampled); None for families without sampling."""
    if "eval_sampled_compression_ratio" in eval_metrics:
        return eval_metrics["eval_sampled_compression_ratio"]
    if _last_logged(log_history, "inference_compression_ratio") is None:
        return None
    return _last_logged(log_history, "compression_ratio")


def _compression_note(trainer: RecipeTrainer, model: PreTrainedModel, evaluated: bool) -> str:
    """Why no compression figure exists: it is logged only at logging steps and evaluations."""
    if getattr(model.config, "model_type", None) == "hidden_decoding":
        return "Hidden Decoding has no concepts"
    if evaluated:
        return "the evaluation reported none"
    steps, every = trainer.state.global_step, trainer.args.logging_steps
    if every <= steps:
        return "the model logged none"
    return f"no logging step in {steps} step(s) with --logging-steps {every:g} and no eval split"


def publish(staging: Path, out: Path) -> None:
    """Move the complete model in `staging` into `out`, config.json last.

    An older model's config.json goes first, so from the first move to the last `out` holds no
    config.json: a folder with one is always a complete model. Older weight shards and indexes are
    removed, so a stale index cannot point at shards of another model.
    """
    (out / "config.json").unlink(missing_ok=True)
    for old in out.glob("model*.safetensors*"):
        old.unlink()
    for entry in sorted(staging.iterdir(), key=lambda item: item.name == "config.json"):
        target = out / entry.name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        os.replace(entry, target)
    staging.rmdir()


def _write_card(staging: Path, out: Path, base_model: str | None, **figures: Any) -> Path | None:
    """The model card in `staging`, its load snippet naming `out` (where the model will be)."""
    try:
        from hf_concept.model_card import write_model_card
    except ImportError as error:
        logger.warning(f"model card skipped: hf_concept.model_card is not available ({error})")
        return None
    extra = {}
    if "name_or_path" in inspect.signature(write_model_card).parameters:
        extra["name_or_path"] = str(out)
    write_model_card(staging, base_model=base_model, **figures, **extra)
    return out / "README.md"


def _save_final(trainer: RecipeTrainer, model: PreTrainedModel, staging: Path, merged: bool) -> None:
    """Write model + tokenizer to `staging`. Every rank calls this (FSDP/DeepSpeed gather the weights)."""
    if trainer.is_world_process_zero():
        shutil.rmtree(staging, ignore_errors=True)
    trainer.accelerator.wait_for_everyone()
    if merged:
        if trainer.is_world_process_zero():
            model.save_pretrained(staging)
            trainer.processing_class.save_pretrained(staging)
    else:
        trainer.save_model(str(staging))
    if trainer.is_world_process_zero():
        # Trainer pickles its arguments next to the weights; a shared checkpoint should not carry a pickle.
        (staging / "training_args.bin").unlink(missing_ok=True)
        restore_remote_code(model, staging)


def built_class(model: PreTrainedModel) -> type:
    """The class `model` was built as. FSDP2's `fully_shard` swaps in a subclass that torch defines
    (`FSDP<Name>`, module `torch.distributed...`); the first non-torch PreTrainedModel class of the
    method resolution order is the model's own."""
    for cls in type(model).__mro__:
        if issubclass(cls, PreTrainedModel) and not cls.__module__.startswith("torch."):
            return cls
    return type(model)


def restore_remote_code(model: PreTrainedModel, folder: Path) -> None:
    """Make a folder saved from an FSDP2-wrapped model load as remote code again.

    `save_pretrained` on the wrapper class copies the wrapper's module and its relative imports (torch's
    `_fsdp_*.py`) and points `auto_map` at the wrapper; here those files are removed, the model's own
    modules copied (`custom_object_save`, as `save_pretrained` does for the model's class) and every
    `auto_map` entry that named the wrapper names the model's class. A plain model is left alone."""
    own = built_class(model)
    wrapper = type(model)
    if own is wrapper:
        return
    from transformers.dynamic_module_utils import custom_object_save

    torch_folder = Path(inspect.getfile(inspect.getmodule(wrapper))).parent
    copied = {path.stem for path in folder.glob("*.py") if (torch_folder / path.name).is_file()}
    for stem in copied:
        (folder / f"{stem}.py").unlink()
    custom_object_save(own, folder)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    auto_map = config.get("auto_map") or {}
    for auto_class, reference in auto_map.items():
        if isinstance(reference, str) and reference.split(".")[0] in copied:
            auto_map[auto_class] = f"{own.__module__.rsplit('.', 1)[-1]}.{own.__name__}"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _final_model(trainer: RecipeTrainer) -> tuple[PreTrainedModel, bool]:
    """(the model to save, whether it is a LoRA model merged into its base)."""
    model = trainer.model
    merged = hasattr(model, "merge_and_unload")
    return (model.merge_and_unload() if merged else model), merged


def _train_result(
    trainer: RecipeTrainer, out: Path, model: PreTrainedModel, eval_metrics: dict[str, float]
) -> TrainResult:
    """The run's figures, from the trainer's log and the final evaluation's metrics."""
    log_history = trainer.state.log_history
    compression = _inference_compression(eval_metrics, log_history)
    result = TrainResult(
        output_dir=out,
        model=model,
        tokenizer=trainer.processing_class,
        log_history=list(log_history),
        global_step=trainer.state.global_step,
        train_loss=_final_train_loss(log_history),
        eval_loss=eval_metrics.get("eval_loss"),
        compression=compression,
        is_main_process=trainer.is_world_process_zero(),
        metrics=dict(eval_metrics),
        sampled_compression=_sampled_compression(eval_metrics, log_history),
    )
    if compression is None:
        result.compression_note = _compression_note(trainer, model, bool(eval_metrics))
    return result


def _training_figures(trainer: RecipeTrainer, details: dict[str, Any], result: TrainResult) -> dict[str, Any]:
    """The model card's training section: the recipe's `details` and the run's settings and figures."""
    state, args = trainer.state, trainer.args
    return {
        **details,
        "steps": state.global_step,
        "epochs": round(float(state.epoch or 0.0), 4),
        "learning_rate": args.learning_rate,
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "world_size": args.world_size,
        "seed": args.seed,
        "final_train_loss": result.train_loss,
    }


def _evaluation_figures(result: TrainResult) -> dict[str, float]:
    """The model card's evaluation section: eval loss and perplexity, and the sampled compression."""
    evaluation = {key: float(value) for key, value in result.metrics.items() if key == "eval_loss"}
    if result.sampled_compression is not None:
        # The card shows both rates: the headline (inference) one and the one training samples at.
        evaluation["training_sampled_compression"] = result.sampled_compression
    if result.eval_loss is not None:
        evaluation["eval_perplexity"] = math.exp(min(result.eval_loss, 50.0))
    return evaluation


def _write_output(
    trainer: RecipeTrainer,
    model: PreTrainedModel,
    merged: bool,
    result: TrainResult,
    base_model: str | None,
    card: dict[str, Any],
) -> None:
    """Save model, tokenizer and card (`card`: its figures) into `result.output_dir` through the staging
    folder; a failure leaves no staging folder, and a write failure becomes an `OutputWriteError`."""
    out = result.output_dir
    staging = out / STAGING_NAME
    try:
        _save_final(trainer, model, staging, merged)
        if result.is_main_process:
            result.card_path = _write_card(staging, out, base_model, **card)
            publish(staging, out)
    except BaseException as error:
        # Nothing half-written stays: the staging folder never looks like a model, but it is garbage.
        if result.is_main_process:
            shutil.rmtree(staging, ignore_errors=True)
        if isinstance(error, Exception) and is_write_failure(error):
            raise OutputWriteError(
                f"could not write the final model into {out}: {write_failure_cause(error, out)}; nothing "
                f"of it was kept: {write_failure_hint(error, '--output-dir')}, then run again with --resume "
                "(the checkpoints are kept)"
            ) from None
        raise


def finish(
    trainer: RecipeTrainer,
    out: Path,
    eval_metrics: dict[str, float],
    details: dict[str, Any],
    base_model: str | None,
) -> TrainResult:
    """Save the trained model (merged if LoRA) with tokenizer and card into `out`; gather the figures."""
    trainer.save_state()
    model, merged = _final_model(trainer)
    result = _train_result(trainer, out, model, eval_metrics)
    card = {
        "training": _training_figures(trainer, details, result),
        "evaluation": _evaluation_figures(result),
        "compression": result.compression,
    }
    trainer.check_finite_weights(model)
    _write_output(trainer, model, merged, result, base_model, card)
    trainer.accelerator.wait_for_everyone()
    return result
