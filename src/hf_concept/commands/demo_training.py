"""The `TrainingArguments` that every training run of `hf-concept demo` shares: the source model's, the two
fine-tunes' (`demo`) and the LSLM stage's (`demo_lslm`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import TrainingArguments


def training_arguments(
    work: Path, name: str, steps: int, lr: float, sizes: Any, seed: int
) -> TrainingArguments:
    """The demo's `TrainingArguments` for one run (`sizes`: any object with `batch_size`)."""
    from transformers import TrainingArguments

    from hf_concept.progress import progress_disabled

    return TrainingArguments(
        output_dir=str(work / f"trainer-{name}"),
        max_steps=steps,
        per_device_train_batch_size=sizes.batch_size,
        learning_rate=lr,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, steps // 10),
        weight_decay=0.01,
        logging_steps=max(1, steps // 4),
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        seed=seed,
        data_seed=seed,
        dataloader_num_workers=0,
        # Otherwise derived from the logging level, which the demo lowers to hide advisory warnings.
        disable_tqdm=progress_disabled(),
    )
