"""Coordinate check of DLCM's decoupled μP (paper §6.1; Yang et al., Tensor Programs V, §D).

Legend: w token width (d_token), 2w concept width (d_concept), T training steps.

For each width w in `--widths` (base width `--base-width`, by default the smallest) a DLCM model is built
with d_token = w, d_concept = 2w, heads = width / `--head-dim` in every stage (fixed head dim), MLP
width 2× the stage width, fixed chunking every R-th token (so concept positions do not move between
widths or steps), then trained T steps with AdamW on one repeated batch of random tokens (fixed seed).
Forward hooks record the output of every encoder, concept and decoder layer, and the logits, on that
batch at init and after training. The figure per layer is the coordinate-wise size of the change,
mean |x_T − x_0|: the quantity μP keeps Θ(1) in width (the activations themselves are also printed).

Two parametrisations, one base learning rate η:
- μP: `mup_base_width` = base width, `mup_optimizer` groups (hidden matrices at η / s, init σ² / s,
  logits × 1 / s_token, ε / s);
- SP: `mup_base_width=None`, every parameter at η, init σ² at every width.

The check passes when, for every layer, the largest change across widths is within `--factor` (2) of the
smallest under μP, and the spread exceeds it under SP for at least one layer. Prints one table per
parametrisation (rows: layers; columns: widths; last column: max / min across widths) and exits 0 when
both halves hold, 1 otherwise.

    python benchmarks/coord_check_dlcm.py [--widths 64,128,256,512] [--lr 3e-3] [--steps 5]
        [--layers 2,2,2] [--seq-len 64] [--batch 4] [--vocab 256] [--head-dim 16] [--ratio 4]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hf_concept.modeling.configuration_dlcm import DLCMConfig
from hf_concept.modeling.modeling_dlcm import DLCMForCausalLM
from hf_concept.tables import format_table
from hf_concept.training import mup_optimizer


@dataclass(frozen=True)
class CoordCheckSetup:
    """Everything but the width and the parametrisation; shared by all runs of one check."""

    widths: tuple[int, ...] = (64, 128, 256, 512)
    base_width: int = 64
    lr: float = 3e-3
    steps: int = 5
    layers: tuple[int, int, int] = (2, 2, 2)
    seq_len: int = 64
    batch_size: int = 4
    vocab_size: int = 256
    head_dim: int = 16
    ratio: int = 4
    seed: int = 0


def dlcm_config(setup: CoordCheckSetup, width: int, mup: bool) -> DLCMConfig:
    """d_token = width, d_concept = 2·width, heads scale with width at a fixed head dim."""
    encoder, concept, decoder = setup.layers
    heads = width // setup.head_dim
    return DLCMConfig(
        vocab_size=setup.vocab_size,
        hidden_size=width,
        intermediate_size=2 * width,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=setup.head_dim,
        concept_hidden_size=2 * width,
        concept_num_attention_heads=2 * heads,
        concept_head_dim=setup.head_dim,
        max_position_embeddings=setup.seq_len,
        encoder_layers=encoder,
        concept_layers=concept,
        decoder_layers=decoder,
        chunking="fixed",
        compression_ratio=float(setup.ratio),
        mup_base_width=setup.base_width if mup else None,
        mup_token_learning_rate=setup.lr,
        mup_concept_learning_rate=setup.lr,
        mup_other_learning_rate=setup.lr,
    )


def record_layers(model: DLCMForCausalLM, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Output of every encoder / concept / decoder layer and the logits on `input_ids` (eval, no grad)."""
    outputs: dict[str, torch.Tensor] = {}
    hooks = []
    backbone = model.model
    for stage in ("encoder_layers", "concept_layers", "decoder_layers"):
        for index, layer in enumerate(getattr(backbone, stage)):
            name = f"{stage.removesuffix('_layers')}.{index}"

            def keep(module, args, output, name=name):
                # Layers return (states, None): (B, L, D) for token layers, (B, C, Dc) for concepts.
                outputs[name] = (output[0] if isinstance(output, tuple) else output).detach().clone()

            hooks.append(layer.register_forward_hook(keep))
    model.eval()
    try:
        with torch.no_grad():
            outputs["logits"] = model(input_ids=input_ids).logits.detach().clone()
    finally:
        for hook in hooks:
            hook.remove()
    return outputs


def train_and_measure(setup: CoordCheckSetup, width: int, mup: bool) -> dict[str, tuple[float, float]]:
    """Per layer (mean |x_T − x_0|, mean |x_T|) after `setup.steps` AdamW steps on one repeated batch."""
    torch.manual_seed(setup.seed)
    model = DLCMForCausalLM(dlcm_config(setup, width, mup))
    generator = torch.Generator().manual_seed(setup.seed + 1)
    input_ids = torch.randint(0, setup.vocab_size, (setup.batch_size, setup.seq_len), generator=generator)
    before = record_layers(model, input_ids)
    if mup:
        optimizer = mup_optimizer(model)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=setup.lr, weight_decay=0.0)
    model.train()
    for _ in range(setup.steps):
        optimizer.zero_grad(set_to_none=True)
        model(input_ids=input_ids, labels=input_ids).loss.backward()
        optimizer.step()
    after = record_layers(model, input_ids)
    return {
        name: ((after[name] - before[name]).abs().mean().item(), after[name].abs().mean().item())
        for name in before
    }


def coord_check(setup: CoordCheckSetup, mup: bool) -> dict[str, dict[int, tuple[float, float]]]:
    """layer -> width -> (mean |x_T − x_0|, mean |x_T|) for one parametrisation."""
    table: dict[str, dict[int, tuple[float, float]]] = {}
    for width in setup.widths:
        for name, figures in train_and_measure(setup, width, mup).items():
            table.setdefault(name, {})[width] = figures
    return table


def spread(by_width: dict[int, tuple[float, float]]) -> float:
    """max / min across widths of the change figure."""
    changes = [change for change, _ in by_width.values()]
    return max(changes) / min(changes)


def largest_spread(table: dict[str, dict[int, tuple[float, float]]]) -> float:
    """The worst layer's max / min across widths."""
    return max(spread(by_width) for by_width in table.values())


def print_table(title: str, table: dict[str, dict[int, tuple[float, float]]], widths: Sequence[int]) -> None:
    print(f"\n{title}: mean |x_T - x_0| (mean |x_T|) per layer and width")
    rows = [
        [name, *(f"{by_width[w][0]:.4f} ({by_width[w][1]:>6.3f})" for w in widths), f"{spread(by_width):.2f}"]
        for name, by_width in table.items()
    ]
    headers = ["layer", *(f"w={w}" for w in widths), "max/min"]
    print(format_table(headers, rows, align="<>", widths=(10, *[20] * len(widths), 9), sep=""))


def parse_ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(","))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--widths", type=parse_ints, default=(64, 128, 256, 512))
    parser.add_argument("--base-width", type=int, default=None, help="default: the smallest width")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--layers", type=parse_ints, default=(2, 2, 2), help="encoder,concept,decoder")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--ratio", type=int, default=4)
    parser.add_argument("--factor", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if len(args.layers) != 3:
        parser.error(f"--layers={args.layers!r} must be three integers: encoder,concept,decoder")
    if min(args.widths) < args.head_dim or any(w % args.head_dim for w in args.widths):
        parser.error(f"--widths={args.widths!r} must be multiples of --head-dim={args.head_dim}")
    return args


@dataclass
class CoordCheckResult:
    """Both tables (layer -> width -> (mean |x_T − x_0|, mean |x_T|)) and the verdict."""

    mup: dict[str, dict[int, tuple[float, float]]]
    sp: dict[str, dict[int, tuple[float, float]]]
    factor: float

    @property
    def passed(self) -> bool:
        """μP within `factor` across widths for every layer, SP beyond it for at least one."""
        return largest_spread(self.mup) <= self.factor < largest_spread(self.sp)


def main(argv: Sequence[str] | None = None) -> CoordCheckResult:
    """Runs both parametrisations and prints the tables and the verdict."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    setup = CoordCheckSetup(
        widths=args.widths,
        base_width=args.base_width or min(args.widths),
        lr=args.lr,
        steps=args.steps,
        layers=args.layers,
        seq_len=args.seq_len,
        batch_size=args.batch,
        vocab_size=args.vocab,
        head_dim=args.head_dim,
        ratio=args.ratio,
        seed=args.seed,
    )
    result = CoordCheckResult(coord_check(setup, mup=True), coord_check(setup, mup=False), args.factor)
    print_table(f"muP (base width {setup.base_width}, lr {setup.lr})", result.mup, setup.widths)
    print_table(f"SP (one lr {setup.lr})", result.sp, setup.widths)
    mup_worst, sp_worst = largest_spread(result.mup), largest_spread(result.sp)
    print(f"\nlargest spread across widths: muP {mup_worst:.2f}, SP {sp_worst:.2f} (factor {args.factor})")
    print("coordinate check " + ("passed" if result.passed else "FAILED"))
    return result


if __name__ == "__main__":
    sys.exit(0 if main().passed else 1)
