"""`train(...)`: the Python API behind `hf-concept train` — load or build a model, read and tokenize local
data, train it with `ConceptTrainer`, and save the final model, its tokenizer and a model card.

Choices (docs/training.md states them for users):
- Model: a checkpoint folder (config.json + safetensors weights) is fine-tuned; a config file, or a folder
  with config.json and no weights, is built from scratch with `seed`. Our families load through our own
  classes, whose `save_pretrained` writes the remote-code files; other model types through transformers'
  Auto classes, for types transformers itself defines (no remote code from anywhere else runs here).
- Tokenizer: `tokenizer=` if given; else the checkpoint's own; else LSLM's byte tokenizer for model_type
  "lslm" (its vocabulary is fixed); else the bundled BPE tokenizer (`hf_concept.data.bpe`).
- Data: `.txt`/`.md` files hold one document per blank-line-separated paragraph (the rule the bundled
  corpus joins its documents with; `txt_documents="file"` makes each file one document); `.json` (a list
  of records, or JSON lines) and `.jsonl` records give their `text_field`; a folder written by `datasets`'
  `save_to_disk` gives its column `text_field` (the split `data_split` of a DatasetDict, default "train");
  `.parquet` files too. Everything is read through `datasets` (`hf_concept.training.datasets_io`: filters
  by column, streaming, and the tokenized cache reused by the next run). Each document is
  tokenized with the tokenizer's own special tokens, gets eos appended if the tokenizer did not add it,
  and is cut into pieces of at most `block_size` tokens; each piece is one training sequence.
- Packing (default): `DataCollatorWithFlattening` joins a batch's sequences into one row whose
  `position_ids` restart at every sequence, so nothing is padded and no sequence reads another (every
  family takes document boundaries from those resets). `packing=False` pads each batch instead.
- LoRA (`lora_settings`): adapters on every attention projection — self-attention q/k/v/o in all
  families, DLCM's and LSLM's cross-attention, ConceptMoE's joint-decoding projections — while the
  boundary router (ConceptMoE and DLCM `chunker`, LSLM `router`) is trained in full through
  `modules_to_save`: it is small (two D×D maps or one FFN), and a frozen router could not follow the
  ratio loss or LSLM's inference-network steps. The final model is saved merged (a plain checkpoint
  that loads without peft); the adapter alone is in the Trainer checkpoints under `checkpoints/`.
- DLCM μP: the param groups of `hf_concept.training.mup` whenever the config sets `mup_base_width` (or
  `mup=True`); `learning_rate`, if given, is the base rate η of all three groups, else the config's
  `mup_*_learning_rate` fields are.
- LSLM: `InterleavedUpdates` with the config's `update_schedule` (0, joint: it drops nothing). Its loss is
  normalised by Trainer's `num_items_in_batch` (the step's predicted bytes), like HF causal LMs, so
  accumulation adds up exactly.
- Output: Trainer checkpoints go to `output_dir/checkpoints`, each written under a hidden staging name and
  renamed once complete (`hf_concept.training.checkpoints`); the final model is written into a staging
  folder inside `output_dir` and moved into place with config.json last, so an interrupted save never
  leaves a folder that looks like a complete checkpoint. A non-empty `output_dir` is refused unless the
  run resumes (`resume`: the newest complete checkpoint; `resume_from`: a given one) or replaces it
  (`overwrite_output_dir`, which removes the earlier checkpoints once the setup has passed). The run holds
  an exclusive lock on `output_dir` throughout (`hf_concept.training.output_lock`); a checkpoint to resume
  from must fit the run (`hf_concept.training.resume`: config, shapes, LoRA, finite, step target) and have
  been written with the same data, batch size, accumulation steps and world size
  (`hf_concept.training.run_settings`, recorded in every checkpoint), unless `resume_changed_settings`.
- Divergence: the first non-finite loss, gradient norm or weight stops the run with `TrainingDivergedError`;
  no checkpoint or final model with non-finite weights is written.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import DistributedType
from transformers import (
    PretrainedConfig,
    PreTrainedModel,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)
from transformers.trainer_utils import align_special_tokens

from hf_concept.modeling.transformers_compat import checkpointing_arguments
from hf_concept.progress import progress_disabled
from hf_concept.training.checkpoints import (
    checkpoint_problems,
    latest_checkpoint,
    remove_stale_staging,
)
from hf_concept.training.data import data_collator, read_documents  # noqa: F401 (read_documents: API)
from hf_concept.training.datasets_io import prepare_datasets
from hf_concept.training.distillation import DistillationTrainer, check_distillation_options, load_teacher
from hf_concept.training.errors import TrainSetupError
from hf_concept.training.options import TrainOptions, trainer_fields
from hf_concept.training.output import TrainResult, finish
from hf_concept.training.output_lock import folder_entries, lock_output_dir
from hf_concept.training.recipe_trainer import RecipeTrainer
from hf_concept.training.resume import check_resume, check_resume_target, restore_without_training
from hf_concept.training.run_settings import check_run_settings, current_settings
from hf_concept.training.trainer import ConceptTrainer

logger = logging.getLogger("hf_concept.train")

# model_type -> (module under hf_concept.modeling, config class, causal-LM class).
FAMILIES = {
    "hf_concept_plain": ("plain", "PlainDecoderConfig", "PlainDecoderForCausalLM"),
    "conceptmoe": ("conceptmoe", "ConceptMoEConfig", "ConceptMoEForCausalLM"),
    "dlcm": ("dlcm", "DLCMConfig", "DLCMForCausalLM"),
    "hidden_decoding": ("hidden_decoding", "HiddenDecodingConfig", "HiddenDecodingForCausalLM"),
    "lslm": ("lslm", "LSLMConfig", "LSLMForCausalLM"),
}
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
# Attention projections of every family: self-attention, DLCM/LSLM cross-attention, ConceptMoE joint
# decoding (`concept_*_proj`). Matched against full module names (PEFT uses re.fullmatch for a string).
LORA_ATTENTION = (
    r".*\.(self_attn|cross_attn)\.(q_proj|k_proj|v_proj|o_proj|concept_q_proj|concept_k_proj|concept_v_proj)"
)
# PEFT `target_modules` for the experts of a MoE block (each expert is an MLP of nn.Linear, so LoRA
# wraps them as modules; no `target_parameters` needed). Shared experts match too; the router `gate` not.
LORA_EXPERT_TARGETS = r".*\.mlp\.(experts\.\d+|shared_expert)\.(gate_proj|up_proj|down_proj)"
# Boundary routers, trained in full under LoRA (see the module docstring).
LORA_ROUTERS = {"conceptmoe": "chunker", "dlcm": "chunker", "lslm": "router"}
DEFAULT_LEARNING_RATE = 3e-4
DEFAULT_BLOCK_SIZE = 512
CHECKPOINTS_NAME = "checkpoints"
# Above this, a learning rate (AdamW's, or μP's base rate) earns a warning.
LARGE_LEARNING_RATE = 0.1


def _is_main_rank() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def _info(message: str) -> None:
    if _is_main_rank():
        logger.info(message)


# ---------------------------------------------------------------------------------------------- model


def _family_classes(model_type: str) -> tuple[type, type]:
    folder, config_name, model_name = FAMILIES[model_type]
    config_module = importlib.import_module(f"hf_concept.modeling.configuration_{folder}")
    model_module = importlib.import_module(f"hf_concept.modeling.modeling_{folder}")
    return getattr(config_module, config_name), getattr(model_module, model_name)


def _read_config_dict(path: Path) -> dict[str, Any]:
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        raise TrainSetupError(f"model={str(path)!r} is neither a config file nor a folder with config.json")
    try:
        values = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise TrainSetupError(f"{config_file} is not valid JSON: {error}") from None
    if not isinstance(values, dict) or "model_type" not in values:
        raise TrainSetupError(f"{config_file} has no model_type")
    return values


def _check_model_type(model_type: str, source: Path) -> None:
    from transformers import CONFIG_MAPPING

    if model_type not in FAMILIES and model_type not in CONFIG_MAPPING:
        raise TrainSetupError(
            f"model_type={model_type!r} in {source} is unknown: use one of {sorted(FAMILIES)} or a "
            "transformers model type such as 'llama'"
        )


def load_model(source: str | Path | PretrainedConfig | PreTrainedModel, seed: int = 0) -> PreTrainedModel:
    """A model from a checkpoint folder (weights loaded), a config file/folder or a config object (built
    from scratch with `seed`), or a model object (returned as is)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if isinstance(source, PreTrainedModel):
        return source
    if isinstance(source, PretrainedConfig):
        set_seed(seed)
        if source.model_type in FAMILIES:
            return _family_classes(source.model_type)[1](source)
        return AutoModelForCausalLM.from_config(source)
    path = Path(source)
    values = _read_config_dict(path)
    model_type = values["model_type"]
    _check_model_type(model_type, path)
    has_weights = path.is_dir() and any((path / name).is_file() for name in WEIGHT_FILES)
    if path.is_dir() and not has_weights and any(path.glob("*.bin")):
        raise TrainSetupError(f"{path} holds only .bin (pickle) weights; convert them to safetensors first")
    try:
        if model_type in FAMILIES:
            config_class, model_class = _family_classes(model_type)
            if has_weights:
                return model_class.from_pretrained(path)
            set_seed(seed)
            return model_class(config_class.from_dict(values))
        if has_weights:
            return AutoModelForCausalLM.from_pretrained(path)
        set_seed(seed)
        values = {key: value for key, value in values.items() if key != "model_type"}
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **values))
    except ValueError as error:
        raise TrainSetupError(f"{path}: {error}") from None


def load_tokenizer(model: PreTrainedModel, source: Any, tokenizer: Any = None) -> Any:
    """The tokenizer to train with (rule: module docstring); a path is loaded with `AutoTokenizer`."""
    from transformers import AutoTokenizer

    if tokenizer is not None and not isinstance(tokenizer, (str, Path)):
        return tokenizer
    if tokenizer is not None:
        if not Path(tokenizer).is_dir():
            raise TrainSetupError(f"tokenizer={str(tokenizer)!r} is not a folder holding a saved tokenizer")
        return AutoTokenizer.from_pretrained(tokenizer, trust_remote_code=True)
    if model.config.model_type == "lslm":
        from hf_concept.modeling.tokenization_lslm import ByteTokenizer

        return ByteTokenizer()
    if isinstance(source, (str, Path)) and Path(source).is_dir():
        folder = Path(source)
        if (folder / "tokenizer_config.json").is_file() or (folder / "tokenizer.json").is_file():
            return AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    try:
        from hf_concept.data.bpe import bundled_tokenizer
    except ImportError as error:
        raise TrainSetupError(f"no tokenizer: pass --tokenizer PATH ({error})") from None
    _info("no tokenizer given or found next to the model: using the bundled BPE tokenizer")
    return bundled_tokenizer()


def _check_vocabulary(model: PreTrainedModel, tokenizer: Any) -> None:
    vocab_size = model.config.vocab_size
    if len(tokenizer) > vocab_size:
        raise TrainSetupError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {vocab_size}: "
            "use a matching --tokenizer or a config with a larger vocab_size"
        )


# ------------------------------------------------------------------------------- LoRA, μP, callbacks


def lora_settings(model: PreTrainedModel) -> dict[str, Any]:
    """`LoraConfig` keyword arguments for `model`'s family: target modules and fully trained modules."""
    model_type = model.config.model_type
    if model_type not in FAMILIES:
        # transformers' own types: PEFT's table of default targets knows them.
        return {}
    settings: dict[str, Any] = {"target_modules": LORA_ATTENTION}
    router = LORA_ROUTERS.get(model_type)
    if router is not None and any(name.endswith(f".{router}") for name, _ in model.named_modules()):
        settings["modules_to_save"] = [router]
    return settings


def apply_lora(model: PreTrainedModel, r: int, alpha: float, dropout: float = 0.0) -> Any:
    """`model` wrapped by PEFT with `lora_settings(model)`."""
    from peft import LoraConfig, get_peft_model

    if not (isinstance(r, int) and r >= 1):
        raise TrainSetupError(f"lora_r={r!r} must be a positive integer")
    config = LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=dropout, task_type="CAUSAL_LM", **lora_settings(model)
    )
    try:
        return get_peft_model(model, config)
    except ValueError as error:
        raise TrainSetupError(f"LoRA for model_type={model.config.model_type!r}: {error}") from None


def _use_mup(model: PreTrainedModel, mup: bool | None) -> bool:
    has_fields = hasattr(model.config, "mup_token_scale")
    if mup and not has_fields:
        raise TrainSetupError(
            f"mup: μP param groups are defined for DLCM only, not model_type={model.config.model_type!r}"
        )
    if mup is None:
        return has_fields and getattr(model.config, "mup_base_width", None) is not None
    return bool(mup)


def ratio_hold_callback(model: PreTrainedModel) -> TrainerCallback:
    """`hold_ratio`'s callback: the config's `compression_ratio` held by the router's threshold."""
    from hf_concept.training.ratio_hold import RatioHold

    if model.config.model_type != "conceptmoe" or getattr(model.config, "chunking", None) != "dynamic":
        chunking = getattr(model.config, "chunking", None)
        raise TrainSetupError(
            f"hold_ratio needs a ConceptMoE with dynamic chunking, not model_type="
            f"{model.config.model_type!r} (chunking={chunking!r})"
        )
    return RatioHold(model, model.config.compression_ratio)


def resolve_callbacks(specs: Sequence[str | TrainerCallback | type]) -> list[Any]:
    """Callbacks from objects, classes, or "module:Class" strings (each class built with no arguments)."""
    callbacks = []
    for spec in specs:
        if isinstance(spec, str):
            module_name, _, class_name = spec.partition(":")
            try:
                spec = getattr(importlib.import_module(module_name), class_name)
            except (ImportError, AttributeError, ValueError) as error:
                raise TrainSetupError(
                    f"callback {spec!r} cannot be imported as MODULE:CLASS ({error})"
                ) from None
        callbacks.append(spec() if isinstance(spec, type) else spec)
    return callbacks


# --------------------------------------------------------------------------------------------- train


def check_output_dir(output_dir: str | Path, overwrite: bool, resuming: bool = False) -> Path:
    """`output_dir` as a Path. Refused when it is a file, or when it is not empty and the run neither
    resumes (`resume`/`resume_from`) nor replaces it (`overwrite`): training into a killed run's folder
    from step 0 would mix its checkpoints with the new run's."""
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        raise TrainSetupError(f"output_dir={str(out)!r} exists and is not a folder")
    if resuming and overwrite:
        raise TrainSetupError("--overwrite-output-dir starts again at step 0: it cannot go with --resume")
    if out.is_dir() and folder_entries(out) and not (overwrite or resuming):
        held = "a model (config.json)" if (out / "config.json").exists() else "files of an earlier run"
        raise TrainSetupError(
            f"output_dir={str(out)!r} is not empty (it holds {held}): pass --resume to continue from its "
            "latest complete checkpoint, --resume-from PATH for a given one, or --overwrite-output-dir to "
            "start again from step 0"
        )
    return out


def resolve_resume(out: Path, resume: bool, resume_from: str | Path | None) -> Path | None:
    """The checkpoint a run continues from: `resume_from` (refused unless complete), or with `resume` the
    newest complete one under `out/checkpoints`. With none there, a folder holding a saved model is
    refused (training from step 0 would overwrite it); otherwise the run starts at step 0, with a warning."""
    if resume and resume_from is not None:
        raise TrainSetupError("give --resume or --resume-from PATH, not both")
    if resume_from is not None:
        problems = checkpoint_problems(resume_from)
        if problems:
            raise TrainSetupError(
                f"resume_from={str(resume_from)!r} is not a complete checkpoint: {'; '.join(problems)}"
            )
        return Path(resume_from)
    if not resume:
        return None
    checkpoint = latest_checkpoint(out / CHECKPOINTS_NAME)
    saved = [name for name in ("config.json", *WEIGHT_FILES) if (out / name).is_file()]
    if checkpoint is None and saved:
        raise TrainSetupError(
            f"--resume: output_dir={str(out)!r} holds a saved model ({', '.join(saved)}) but "
            f"{out / CHECKPOINTS_NAME} holds no complete checkpoint to continue from (was it trained with "
            "--save-steps 0?), and starting at step 0 would overwrite that model: choose another "
            "--output-dir, --resume-from a checkpoint, or --overwrite-output-dir to replace it"
        )
    if checkpoint is None:
        logger.warning(f"--resume: {out / CHECKPOINTS_NAME} holds no complete checkpoint; starting at step 0")
    else:
        _info(f"resuming from {checkpoint}")
    return checkpoint


def check_schedule(learning_rate: float | None, max_steps: int) -> None:
    """Refuse a learning rate that cannot train and a step count that means nothing; warn on a rate so
    large that training will likely diverge."""
    if learning_rate is not None:
        is_number = isinstance(learning_rate, int | float) and math.isfinite(learning_rate)
        if not (is_number and learning_rate > 0):
            raise TrainSetupError(f"learning_rate={learning_rate!r} must be a positive finite number")
        if learning_rate > LARGE_LEARNING_RATE:
            logger.warning(
                f"learning_rate={learning_rate:g} is very large (above {LARGE_LEARNING_RATE:g}): training "
                "will likely diverge (it stops at the first non-finite loss)"
            )
    if not (isinstance(max_steps, int) and (max_steps >= 1 or max_steps == -1)):
        raise TrainSetupError(
            f"max_steps={max_steps!r} must be a positive number of optimizer steps, or -1 to train for "
            "num_train_epochs"
        )


def resolve_block_size(model: PreTrainedModel, block_size: int | None) -> int:
    """`block_size`, checked against the model's max_position_embeddings; None: the smaller of 512 and it."""
    limit = getattr(model.config, "max_position_embeddings", None)
    limit = limit if isinstance(limit, int) and limit >= 2 else None
    if block_size is None:
        return min(DEFAULT_BLOCK_SIZE, limit or DEFAULT_BLOCK_SIZE)
    if limit is not None and block_size > limit:
        raise TrainSetupError(f"block_size={block_size} exceeds the model's max_position_embeddings={limit}")
    return block_size


def training_arguments(folder: Path, options: TrainOptions, has_eval: bool) -> TrainingArguments:
    """`TrainingArguments` for the run: the options marked `trainer=True` by name, plus the ones the
    recipe words itself (learning-rate default, save/eval strategies, activation checkpointing, CPU)."""
    fields = trainer_fields(options)
    if fields.get("disable_tqdm") is None and progress_disabled():
        # Trainer's bar follows the tools' policy: none in a log that is not a terminal.
        fields["disable_tqdm"] = True
    try:
        return TrainingArguments(
            output_dir=str(folder),
            per_device_eval_batch_size=options.per_device_train_batch_size,
            learning_rate=DEFAULT_LEARNING_RATE if options.learning_rate is None else options.learning_rate,
            save_strategy="steps" if options.save_steps > 0 else "no",
            save_steps=max(options.save_steps, 1),
            eval_strategy="steps" if has_eval and options.eval_steps else "no",
            eval_steps=options.eval_steps,
            **checkpointing_arguments(options.gradient_checkpointing),
            data_seed=options.seed,
            use_cpu=options.use_cpu or _no_accelerator(),
            # Evaluation needs the loss only; collecting logits would cost memory for nothing.
            prediction_loss_only=True,
            **fields,
        )
    except ValueError as error:
        raise TrainSetupError(f"training arguments: {error}") from None


def train(
    model_or_path: str | Path | PretrainedConfig | PreTrainedModel,
    data: str | Path | Sequence[str | Path],
    output_dir: str | Path,
    **options: Any,
) -> TrainResult:
    """Train `model_or_path` on `data` and save the result to `output_dir` (choices: module docstring).

    `options` are the fields of `hf_concept.training.options.TrainOptions` (each with its help, and
    `hf-concept train`'s flag of the same name): `train_with(model_or_path, TrainOptions(data=...,
    output_dir=..., **options))`. Raises `TrainSetupError` for input problems found before training
    starts, and `TrainingDivergedError` when the loss, a gradient norm or a weight stops being finite
    (nothing non-finite is saved).
    """
    return train_with(model_or_path, TrainOptions(data=data, output_dir=output_dir, **options))


def train_with(
    model_or_path: str | Path | PretrainedConfig | PreTrainedModel, options: TrainOptions
) -> TrainResult:
    """`train` with its options as one `TrainOptions`."""
    check_schedule(options.learning_rate, options.max_steps)
    resuming = options.resume or options.resume_from is not None
    if options.resume_changed_settings and not resuming:
        raise TrainSetupError("--resume-changed-settings goes with --resume or --resume-from PATH")
    # One run per output folder for the whole run; the checks below see the folder as this run left it.
    with lock_output_dir(options.output_dir, main_process=_is_main_rank()) as session:
        out = check_output_dir(session.path, options.overwrite_output_dir, resuming=resuming)
        checkpoint = resolve_resume(out, options.resume, options.resume_from)
        at_target = checkpoint is not None and check_resume_target(checkpoint, options.max_steps)
        setup = prepare_run(model_or_path, options, checkpoint)
        args = training_arguments(out / CHECKPOINTS_NAME, options, has_eval=setup.eval_set is not None)
        settings = current_settings(options.data, args, options.distill_from)
        if checkpoint is not None:
            # Before Trainer is built (it makes folders in the output directory): a refusal changes nothing.
            check_run_settings(checkpoint, settings, options.resume_changed_settings)
        trainer = build_trainer(setup, args, options)
        trainer.run_settings = settings
        check_sharding_took_effect(trainer)
        _clear_checkpoint_folder(trainer, out / CHECKPOINTS_NAME, everything=options.overwrite_output_dir)
        # From here on a failed run keeps what it wrote (checkpoints); before, a folder it made is removed.
        session.started = True
        if at_target:
            restore_without_training(trainer, checkpoint)
        else:
            trainer.train(resume_from_checkpoint=None if checkpoint is None else str(checkpoint))
        eval_metrics = trainer.evaluate() if setup.eval_set is not None else {}
        details = run_details(options, setup)
        return finish(
            trainer, out, eval_metrics, details, options.base_model or _base_model_name(model_or_path)
        )


@dataclass
class RunSetup:
    """What a run trains before Trainer exists: the model (LoRA-wrapped when asked), its tokenizer, the
    datasets, the callbacks and the choices resolved from the model (block size, μP)."""

    model: Any
    tokenizer: Any
    train_set: Any
    eval_set: Any
    callbacks: list[Any]
    block_size: int
    use_mup: bool
    # The source model that teaches this one (`--distill-from`), or None.
    teacher: Any = None


def prepare_run(model_or_path: Any, options: TrainOptions, checkpoint: Path | None) -> RunSetup:
    """Load the model and tokenizer, read the data, resolve callbacks, apply LoRA, check the checkpoint."""
    check_distillation_options(options.distill_from, options.distill_temperature, options.align_hidden)
    model = load_model(model_or_path, options.seed)
    tokenizer = load_tokenizer(model, model_or_path, options.tokenizer)
    _check_vocabulary(model, tokenizer)
    teacher = None if options.distill_from is None else load_teacher(options.distill_from, model, tokenizer)
    block_size = resolve_block_size(model, options.block_size)
    train_set, eval_set = prepare_datasets(
        options.data,
        tokenizer,
        eval_data=options.eval_data,
        eval_split_fraction=options.eval_split_fraction,
        text_field=options.text_field,
        txt_documents=options.txt_documents,
        block_size=block_size,
        seed=options.seed,
        encoding_errors=options.encoding_errors,
        data_split=options.data_split,
        eval_data_split=options.eval_data_split,
        data_filter=options.data_filter,
        streaming=options.streaming,
        max_steps=options.max_steps,
    )
    use_mup = _use_mup(model, options.mup)
    callbacks = resolve_callbacks(options.callbacks)
    if options.hold_ratio:
        callbacks.append(ratio_hold_callback(model))
    if options.lora:
        set_seed(options.seed)
        model = apply_lora(model, options.lora_r, options.lora_alpha, options.lora_dropout)
    if checkpoint is not None:
        # Trainer writes the tokenizer's pad/bos/eos ids into the config when training starts, so the
        # checkpoint holds them: compare it with the config this run will train under.
        align_special_tokens(model, tokenizer)
        check_resume(model, checkpoint, options.lora)
    return RunSetup(model, tokenizer, train_set, eval_set, callbacks, block_size, use_mup, teacher)


def run_details(options: TrainOptions, setup: RunSetup) -> dict[str, Any]:
    """What the saved run reports about its data and recipe (`finish`)."""
    data = options.data
    return {
        "data": [str(path) for path in ([data] if isinstance(data, (str, Path)) else data)],
        "block_size": setup.block_size,
        "packing": options.packing,
        "lora": {"r": options.lora_r, "alpha": options.lora_alpha} if options.lora else None,
        "mup": setup.use_mup,
        "train_sequences": None if options.streaming else len(setup.train_set),
    }


def build_trainer(setup: RunSetup, args: TrainingArguments, options: TrainOptions) -> RecipeTrainer:
    """The `RecipeTrainer` of a run; LSLM gets its update schedule, a run with `--distill-from` the
    `DistillationTrainer`."""
    callbacks = setup.callbacks
    if setup.model.config.model_type == "lslm":
        from hf_concept.training.lslm import InterleavedUpdates

        callbacks = [*callbacks, InterleavedUpdates()]
    trainer_class, teaching = RecipeTrainer, {}
    if setup.teacher is not None:
        trainer_class = DistillationTrainer
        teaching = dict(
            teacher_model=setup.teacher,
            distill_temperature=options.distill_temperature,
            align_hidden=options.align_hidden,
        )
    return trainer_class(
        model=setup.model,
        args=args,
        train_dataset=setup.train_set,
        eval_dataset=setup.eval_set,
        data_collator=data_collator(setup.tokenizer, options.packing),
        processing_class=setup.tokenizer,
        callbacks=callbacks,
        mup=setup.use_mup,
        mup_learning_rate=options.learning_rate,
        **teaching,
    )


def check_sharding_took_effect(trainer: ConceptTrainer) -> None:
    """Refuse a run that asked for FSDP (`accelerate launch --use_fsdp` or a config with it) but that
    accelerate runs unsharded: on processes without a GPU-like device accelerate 1.15 keeps DDP and says
    nothing (docs/training.md, "FSDP"). Training on would silently hold every weight on every rank. (An
    output folder the run made is removed again by `lock_output_dir`: training has not started.)"""
    asked = os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true", "yes")
    actual = trainer.accelerator.distributed_type
    if asked and actual != DistributedType.FSDP:
        raise TrainSetupError(
            f"FSDP was asked for (ACCELERATE_USE_FSDP={os.environ['ACCELERATE_USE_FSDP']}) but accelerate "
            f"runs this as {actual.value}, unsharded: it enables FSDP only on GPU-like devices "
            '(docs/training.md, "FSDP"); launch on GPUs, or without --use_fsdp'
        )


def _clear_checkpoint_folder(trainer: ConceptTrainer, folder: Path, everything: bool) -> None:
    """Before training: remove an earlier run's checkpoints (`everything`, i.e. --overwrite-output-dir) or
    only the staging folders a killed run left half-written. Done once the whole setup has passed."""
    if trainer.is_world_process_zero():
        if everything and folder.exists():
            _info(f"--overwrite-output-dir: removing the earlier run's checkpoints in {folder}")
            shutil.rmtree(folder)
            # Trainer made the folder when it was built, and writes its state there at the end.
            folder.mkdir(parents=True)
        remove_stale_staging(folder)
    trainer.accelerator.wait_for_everyone()


def _no_accelerator() -> bool:
    """No GPU (CUDA, XPU, MPS) here: Trainer must be told to use the CPU, or bf16 and accelerate's
    gloo/CPU data parallelism are refused (several processes would then each train alone)."""
    backends = (torch.cuda, getattr(torch, "xpu", None), getattr(torch.backends, "mps", None))
    return not any(backend is not None and backend.is_available() for backend in backends)


def _base_model_name(source: Any) -> str | None:
    """The checkpoint a run started from (None when built from scratch)."""
    if isinstance(source, PreTrainedModel):
        return source.name_or_path or None
    is_folder = isinstance(source, (str, Path)) and Path(source).is_dir()
    if is_folder and any((Path(source) / name).is_file() for name in WEIGHT_FILES):
        return str(source)
    return None
