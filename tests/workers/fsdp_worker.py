"""`hf-concept train` under accelerate's FSDP2, for tests/test_fsdp_training.py.

Usage: accelerate launch --config_file examples/accelerate/fsdp2.yaml tests/workers/fsdp_worker.py train ...

The script runs the real command (`hf_concept.cli.main`). On a machine without a GPU it first calls
`keep_fsdp_on_cpu`: accelerate 1.15 turns FSDP on only for accelerator devices and otherwise trains with
plain data parallelism, silently (docs/training.md, "FSDP"). torch's FSDP2 itself runs on CPU with gloo,
so the worker puts the plugin back and everything after that (the `fully_shard` wrapping, Trainer's FSDP
paths, the gathered full state dict at the final save) is accelerate's and Trainer's own code.

`RecordShardedRun` (pass `--callback tests.workers.fsdp_worker:RecordShardedRun`) writes what
`RecordRanks` records, plus how the parameters are sharded, every training micro-batch's inputs, the
gathered parameters after training and the logits of a fixed batch computed by the trained (sharded) model.
It works the same under DDP (no sharding), which is how the test records its reference run.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from tests.workers.train_worker import RECORD_DIR_ENV, RecordRanks

# The fixed batch whose logits the trained model records (ids below every tiny test vocabulary).
PROBE_SHAPE = (2, 19)
PROBE_SEED = 11
INPUT_FIELDS = ("input_ids", "attention_mask", "position_ids")


def probe_input_ids(vocab_size: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(PROBE_SEED)
    return torch.randint(3, vocab_size, PROBE_SHAPE, generator=generator)


def keep_fsdp_on_cpu() -> None:
    """Let accelerate's FSDP2 plugin take effect on CPU processes (gloo).

    `AcceleratorState.__init__` (accelerate/state.py) sets `DistributedType.FSDP` only inside its branch
    for GPU-like devices (MULTI_GPU, MULTI_XPU, ...); on MULTI_CPU it keeps data parallelism and never
    stores the plugin. This wrapper stores it and sets FSDP, in the state that every later
    `AcceleratorState()` copies (`PartialState`'s) as well as in its own.
    """
    import accelerate.state as accelerate_state
    from accelerate.utils import DistributedType

    original_init = accelerate_state.AcceleratorState.__init__

    def init(self, *args, fsdp_plugin=None, **kwargs):
        original_init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            if fsdp_plugin.fsdp_version != 2:
                raise ValueError("on CPU only FSDP2 runs (accelerate's FSDP1 plugin needs a GPU)")
            accelerate_state.PartialState().distributed_type = DistributedType.FSDP
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    accelerate_state.AcceleratorState.__init__ = init


class RecordShardedRun(RecordRanks):
    """`RecordRanks`, plus "sharding", "inputs", "full_parameters" and "logits" (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.inputs: list[dict[str, torch.Tensor]] = []
        self.sharding: dict = {}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        super().on_train_begin(args, state, control, model=model, **kwargs)
        parameters = dict(model.named_parameters())
        self.sharding = {
            # FSDP2 turns each module it wraps into an FSDPModule: the names of those ("" is the root).
            "units": [name for name, module in model.named_modules() if isinstance(module, FSDPModule)],
            "distributed": {name: isinstance(value, DTensor) for name, value in parameters.items()},
            "local": {name: _local(value).numel() for name, value in parameters.items()},
            "full": {name: value.numel() for name, value in parameters.items()},
        }

    def _record_forward(self, module, args, kwargs, output) -> None:
        super()._record_forward(module, args, kwargs, output)
        if module.training:
            fields = {name: kwargs.get(name) for name in INPUT_FIELDS}
            self.inputs.append(
                {name: value.detach().cpu() for name, value in fields.items() if value is not None}
            )

    def on_train_end(self, args, state, control, model=None, **kwargs):
        # Every rank takes part: gathering a sharded parameter and the forward are collectives under FSDP.
        full = {name: _full(value) for name, value in model.named_parameters()}
        was_training = model.training
        model.eval()
        with torch.no_grad():
            probe = probe_input_ids(model.config.vocab_size).to(args.device)
            logits = model(input_ids=probe).logits.detach().cpu()
        model.train(was_training)
        record = {
            "steps": self.steps,
            "micro_batches": self.micro_batches,
            "logs": self.logs,
            "world_size": args.world_size,
            "sharding": self.sharding,
            "inputs": self.inputs,
            "full_parameters": full,
            "logits": logits,
        }
        _save_record(record)


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def _full(value: torch.Tensor) -> torch.Tensor:
    value = value.full_tensor() if isinstance(value, DTensor) else value
    return value.detach().cpu().clone()


def _save_record(record: dict) -> None:
    torch.save(record, Path(os.environ[RECORD_DIR_ENV]) / f"rank{os.environ.get('RANK', '0')}.pt")


def main(argv: list[str]) -> int:
    if not torch.cuda.is_available():
        keep_fsdp_on_cpu()
    from hf_concept import cli

    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
