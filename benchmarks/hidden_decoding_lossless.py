"""Does a Hidden Decoding conversion keep its source's predictions? Held-out loss and max |Δlogit| of a
converted real checkpoint against the source, before any training.

For each n in `--streams`, the source is converted twice with the default layout (one full layer in
four) and token positions in intra layers: with the paper's cross-stream form (causal masks over the
expanded sequence, expanded RoPE positions p·n + k: the conversion's form before token-block masks became
its default) and with the conversion default (token-block masks, token positions). Each model scores the
bundled English held-out text (`hf_concept.data.load_text("en", "heldout")`, tokenized by the source's
tokenizer) in non-overlapping windows of `--context` tokens (the first `--windows`); the table gives the
loss (nats per token), its change against the source, and the largest |Δlogit| over every scored
position. Converted folders go to a temporary directory and are removed after scoring.

    python benchmarks/hidden_decoding_lossless.py SRC [--streams 2,4] [--context 512] [--windows 4]
        [--threads 2]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_concept.conversion import convert_to_hidden_decoding
from hf_concept.data import load_text
from hf_concept.modeling.modeling_hidden_decoding import HiddenDecodingForCausalLM
from hf_concept.tables import format_table

FORMS = {
    "paper (causal, expanded)": dict(cross_stream_mask="causal", cross_stream_positions="expanded"),
    "default (token_block, token)": dict(cross_stream_mask="token_block", cross_stream_positions="token"),
}


def heldout_windows(source: Path, context: int, windows: int) -> torch.Tensor:
    """(N, context) token ids of the English held-out text, non-overlapping windows."""
    tokenizer = AutoTokenizer.from_pretrained(source)
    ids = tokenizer(load_text("en", "heldout"), add_special_tokens=False)["input_ids"]
    count = min(windows, len(ids) // context)
    return torch.tensor(ids[: count * context]).view(count, context)


@torch.no_grad()
def score(model, rows: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Mean next-token loss over all windows and the (N, context, V) logits."""
    model.eval()
    logits = torch.stack([model(input_ids=row[None]).logits[0] for row in rows])
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), rows[:, 1:].flatten())
    return loss.item(), logits


def converted_rows(
    src: Path, streams: list[int], windows: torch.Tensor, source_loss: float, source_logits: torch.Tensor
) -> Iterator[list[str]]:
    """The table's rows: the source's, then each conversion's, converted and scored on `windows` when the
    table asks for the row."""
    yield ["source", f"{source_loss:.4f}", "—", "—", "—"]
    for count in streams:
        for name, settings in FORMS.items():
            started = time.perf_counter()
            with tempfile.TemporaryDirectory() as folder:
                destination = Path(folder) / "hd"
                convert_to_hidden_decoding(src, destination, num_streams=count, **settings)
                loss, logits = score(HiddenDecodingForCausalLM.from_pretrained(destination), windows)
                shutil.rmtree(destination)
            delta = (logits - source_logits).abs().max().item()
            seconds = time.perf_counter() - started
            yield [
                f"n={count}, {name}",
                f"{loss:.4f}",
                f"{loss - source_loss:+.4f}",
                f"{delta:.2e}",
                f"{seconds:.0f}",
            ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path, help="Source checkpoint folder (safetensors + tokenizer).")
    parser.add_argument("--streams", default="2,4", help="Comma-separated stream counts.")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = heldout_windows(args.src, args.context, args.windows)
    source_loss, source_logits = score(AutoModelForCausalLM.from_pretrained(args.src), rows)
    print(f"held-out text: {rows.numel()} tokens in {len(rows)} windows of {args.context}")
    headers = ("model", "loss (nats/token)", "Δ loss", "max abs Δlogit", "seconds")
    streams = [int(value) for value in args.streams.split(",")]
    table = converted_rows(args.src, streams, rows, source_loss, source_logits)
    # Each row is printed as soon as its conversion is scored.
    format_table(headers, table, markdown=True, emit=print)


if __name__ == "__main__":
    main()
