"""One optimizer step of a tiny LSLM under a `Trainer`, for tests/test_lslm_hf_contracts.py: in-process
(with and without gradient accumulation) and under torchrun (two ranks, gloo, CPU).

Usage: python -m torch.distributed.run --nproc_per_node 2 tests/workers/lslm_trainer_worker.py OUT_DIR

Every rank runs `train_one_step` with two rows per device and writes OUT_DIR/rank{r}.pt: the step's logged
loss, the gradients the optimizer saw (after DDP's all-reduce) and the updated parameters.

Training-mode randomness is removed so that both sides of a comparison take the same decisions: the
boundary sampler's Gumbel noise is zero (a byte ends its segment when the router's q reaches the
threshold) and the config has no dropout. Plain SGD without clipping or weight decay makes the update a
fixed multiple of the gradient, so a loss scaled wrongly shows up in the parameters too.

Rows are padded on the right. Trainer's `num_items_in_batch` counts `labels[..., 1:] != -100`;
`PaddingCollator` leaves each row's first token unlabelled on either side, so the count is the predicted
bytes whatever the padding (tests/test_lslm_hf_contracts.py checks the collator for both sides).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_concept.modeling import modeling_lslm
from hf_concept.training.data import PaddingCollator
from tests.conformance.families import _lslm_config

# Bytes per row: any two rows hold another number of bytes than the other two, so DDP's halves differ in
# size whatever rows the sampler gives each rank, and the rows need padding in a batch.
ROW_LENGTHS = (5, 9, 17, 33)


def build_rows() -> list[dict[str, list[int]]]:
    """`<BoS>` random bytes `<eos>` rows of `ROW_LENGTHS` bytes (ByteTokenizer ids)."""
    generator = torch.Generator().manual_seed(7)
    rows = []
    for length in ROW_LENGTHS:
        content = torch.randint(5, 261, (length,), generator=generator).tolist()
        rows.append({"input_ids": [1, *content, 2]})
    return rows


def build_model() -> modeling_lslm.LSLMForCausalLM:
    """The conformance suite's tiny LSLM (tests/conformance/families.py), seeded, without dropout."""
    config = _lslm_config(kl_weight=0.5, attention_dropout=0.0)
    torch.manual_seed(0)
    return modeling_lslm.LSLMForCausalLM(config)


def zero_gumbel_noise(
    shape: tuple[int, ...], generator: Any = None, device: Any = None, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """`routing.sample_gumbel_noise` without the noise."""
    zeros = torch.zeros(shape, device=device, dtype=dtype)
    return zeros, zeros


class RecordStep(TrainerCallback):
    """The gradients the optimizer is about to apply (after accumulation, and DDP's all-reduce)."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads = {
            name: parameter.grad.detach().clone()
            for name, parameter in model.named_parameters()
            if parameter.grad is not None
        }


def train_one_step(
    trainer_class: type[Trainer], out_dir: str | Path, per_device: int, accumulation: int
) -> dict[str, Any]:
    """Train `build_model()` one optimizer step on `build_rows()`; the logged loss, gradients, parameters."""
    args = TrainingArguments(
        output_dir=str(out_dir),
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
        max_steps=1,
        learning_rate=0.5,
        optim="sgd",
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    recorder = RecordStep()
    with mock.patch.object(modeling_lslm, "sample_gumbel_noise", zero_gumbel_noise):
        trainer = trainer_class(
            model=build_model(),
            args=args,
            train_dataset=build_rows(),
            data_collator=PaddingCollator(pad_token_id=0, padding_side="right"),
            callbacks=[recorder],
        )
        trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    return {
        "loss": torch.tensor(losses[0], dtype=torch.float64),
        "grads": recorder.grads,
        "parameters": {name: value.detach().clone() for name, value in trainer.model.named_parameters()},
        "world_size": args.world_size,
    }


def main(out_dir: str) -> None:
    result = train_one_step(Trainer, out_dir, per_device=2, accumulation=1)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    if torch.distributed.is_initialized():
        # Left to interpreter exit, gloo's threads can abort a rank that succeeded.
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
