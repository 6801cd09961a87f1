"""Where a sweep run's held-out − training gap comes from: memorised windows, or other documents.

Each scaled run should end with held-out loss − training loss below 0.05 nats (REPRODUCTION.md, the scaled
sweeps on the built corpus). On `--corpus` no window is read twice, so a gap cannot come from repetition;
this script shows what it does come from.
It loads a model a sweep saved (the pretrained sources under `DIR/models`), rebuilds the windows it read
(its seed's order, `--read-windows` of them), and scores the same weights, per language/kind cell, on

- `read`: windows spread evenly over the ones it trained on,
- `unread`: the next windows of its order (train documents, never seen),
- `validation`: the validation split (other documents), cut as the held-out one is,
- `held-out`: the runner's own held-out set (the figure its record holds, as a check), cut by
  `--heldout-sample` (give `first` for a model of a sweep begun before that flag: each cell's first
  documents),
- `validation, spread` and `held-out, spread`: windows spread evenly over *all* of a cell's documents in
  those splits (the `first` cut rests on 1 to 58 documents per cell),

each with the held-out set's tokens per cell (`--heldout-tokens`, shared as the runners share it), so
that the pooled figures are over one mix.

`read` ≈ `unread` means nothing was memorised; `unread` < `validation` ≈ `held-out` then means the gap is
the other documents' text (a book, a man page, a poem collection the model never saw the like of), which more
steps on the train documents do not close. Nothing here is a choice: no figure feeds a setting.

    .venv/bin/python benchmarks/heldout_gap.py --corpus /work/cache/corpus \
        --model /work/cache/sweeps/hidden-decoding/models/seed0/source --context 128 \
        --order-seed 0 --read-windows 64000
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy
import torch

from hf_concept.tables import format_table

sys.path.insert(0, str(Path(__file__).resolve().parent))

import corpus_data
import reproduce_dlcm

SPLITS = ("read", "unread", "validation", "held-out", "validation, spread", "held-out, spread")
COLLECTIONS = 5
COLLECTION_WINDOWS = 120


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    corpus_data.add_corpus_flags(parser)
    parser.add_argument("--model", required=True, help="a saved model folder (`save_pretrained`)")
    parser.add_argument("--context", type=int, required=True, help="the run's --context")
    parser.add_argument("--order-seed", type=int, required=True, help="the seed whose window order it read")
    parser.add_argument("--read-windows", type=int, required=True, help="windows it read (steps × batch)")
    parser.add_argument(
        "--by-collection",
        metavar="KIND",
        help="also score each split's documents of this kind (e.g. classical) per collection: the document "
        f"name with its digits folded to N, {COLLECTION_WINDOWS} random windows of the largest "
        f"{COLLECTIONS} collections per split",
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="write the figures here")
    return parser.parse_args(argv)


def train_samples(data: dict, args: argparse.Namespace) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """("language/kind", ids) windows of the train split, as many per cell as the held-out set has tokens
    (so that the pooled figures are over the same mix): `read` spread evenly over the cell's windows the
    run read, `unread` the cell's next windows in its order."""
    windows = data["windows"]
    order = windows.order(args.order_seed)
    if args.read_windows > len(order):
        raise SystemExit(f"--read-windows {args.read_windows}: more than the {len(order)} windows of the "
                         "train split")  # fmt: skip
    cells = numpy.array(corpus_data.window_cells(data, order))
    samples: dict[str, list] = dict(read=[], unread=[])
    for cell, tokens in sorted(data["heldout_tokens"].items()):
        count = -(-tokens // windows.context)
        read = order[: args.read_windows][cells[: args.read_windows] == cell]
        unread = order[args.read_windows :][cells[args.read_windows :] == cell][:count]
        if len(read) < count or len(unread) < count:
            raise SystemExit(f"cell {cell}: {count} windows needed, {len(read)} read and {len(unread)} "
                             "unread in the train split")  # fmt: skip
        spread = read[corpus_data.evenly_spaced(len(read), count)]
        for name, picked in (("read", spread), ("unread", unread)):
            samples[name] += [(cell, windows.ids(index)) for index in picked.tolist()]
    return samples


def split_ids(args: argparse.Namespace) -> dict:
    """Every split of `--corpus`, tokenised (the caches the runners use)."""
    from hf_concept.training.data import load_saved_dataset

    folder = Path(args.corpus)
    corpus = load_saved_dataset(folder)
    if "validation" not in corpus:
        raise SystemExit(f"--corpus {folder}: no validation split (it has {sorted(corpus)})")
    return corpus_data.tokenized_splits(folder, corpus, corpus_data.SPLITS)[1]


def other_documents(
    data: dict, ids: dict, args: argparse.Namespace
) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """The validation split cut as `load_corpus` cuts the held-out one (`--heldout-sample`, the same
    tokens per cell), and both splits' windows spread over all their documents
    (`corpus_data.spread_windows`, as many per cell). Under `spread` a cut and its spread sample are the
    same list (the runner's held-out set is `data["heldout"]`), which `main` scores once."""
    limits = corpus_data.heldout_limits(data["train_tokens"], args.heldout_tokens, args.context)
    validation = corpus_data.spread_windows(ids["validation"], limits, args.context)
    if corpus_data.heldout_sample(args) == "first":
        heldout = corpus_data.spread_windows(ids["held_out"], limits, args.context)
        cut = corpus_data.heldout_documents(ids["validation"], limits)
    else:
        heldout, cut = data["heldout"], validation
    return {"validation": cut, "validation, spread": validation, "held-out, spread": heldout}


def collection_of(document: str) -> str:
    """A document id's collection: its last path part with every run of digits folded to N."""
    return re.sub(r"[0-9]+", "N", document.rsplit("/", 1)[-1])


def by_collection(model, ids: dict, args: argparse.Namespace) -> dict[str, dict[str, dict]]:
    """Per split, per collection of `--by-collection`'s kind: the collection's windows and the LM loss
    of `COLLECTION_WINDOWS` of them drawn at random (numpy seed 0)."""
    figures: dict[str, dict[str, dict]] = {}
    for split, tokenized_split in ids.items():
        tokens, offsets = corpus_data.flat_ids(tokenized_split)
        windows = corpus_data.WindowOrder(tokens, offsets, args.context)
        documents = windows.documents(offsets)
        kinds, names = tokenized_split["kind"], tokenized_split["document"]
        groups: dict[str, list[int]] = {}
        for index, document in enumerate(documents.tolist()):
            if kinds[document] == args.by_collection:
                groups.setdefault(collection_of(names[document]), []).append(index)
        rng = numpy.random.default_rng(0)
        figures[split] = {}
        for name, members in sorted(groups.items(), key=lambda item: -len(item[1]))[:COLLECTIONS]:
            picked = rng.choice(members, size=min(COLLECTION_WINDOWS, len(members)), replace=False)
            rows = [(name, windows.ids(index)) for index in picked.tolist()]
            figures[split][name] = dict(windows=len(members), loss=score(model, rows, args.context)["loss"])
            print(
                f"{split} {name}: {len(members)} windows, loss {figures[split][name]['loss']:.3f}", flush=True
            )
    return figures


@torch.no_grad()
def score(model: torch.nn.Module, documents: list[tuple[str, torch.Tensor]], context: int) -> dict:
    """LM loss in nats per token, pooled and per cell, over `context`-token windows of `documents` (as the
    runners score their held-out set)."""
    nats: dict[str, float] = {}
    predicted: dict[str, int] = {}
    for cell, window in reproduce_dlcm.heldout_windows(documents, context):
        if len(window) < 2:
            continue
        logits = model(input_ids=window[None], use_cache=False).logits  # (1, L, V)
        loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), window[1:], reduction="sum")
        nats[cell] = nats.get(cell, 0.0) + float(loss)
        predicted[cell] = predicted.get(cell, 0) + len(window) - 1
    cells = {cell: nats[cell] / predicted[cell] for cell in sorted(nats)}
    tokens = sum(predicted.values())
    return dict(loss=sum(nats.values()) / tokens, cells=cells, tokens=tokens)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    if args.corpus is None:
        raise SystemExit("--corpus is required: the saved corpus the run trained on")
    if not (Path(args.model) / "config.json").is_file():
        raise SystemExit(f"--model {args.model}: no config.json there (a folder saved with save_pretrained)")
    data = corpus_data.load_corpus(args)
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    ids = split_ids(args)
    documents = dict(train_samples(data, args), **other_documents(data, ids, args))
    documents["held-out"] = data["heldout"]
    # A list two names share (see `other_documents`) is scored once.
    scored: dict[int, dict] = {}
    for name in SPLITS:
        if id(documents[name]) not in scored:
            scored[id(documents[name])] = score(model, documents[name], args.context)
    figures = {name: scored[id(documents[name])] for name in SPLITS}
    print_table(figures)
    collections = by_collection(model, ids, args) if args.by_collection else None
    record = dict(model=args.model, splits=figures, collections=collections)
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    return record


def print_table(figures: dict) -> None:
    cells = sorted({cell for split in figures.values() for cell in split["cells"]})
    rows = []
    for name, split in figures.items():
        losses = [f"{split['cells'][cell]:.3f}" if cell in split["cells"] else "-" for cell in cells]
        rows.append([name, split["tokens"], f"{split['loss']:.3f}", *losses])
    print(format_table(["split", "tokens", "all", *cells], rows, align="<>", markdown=True))


if __name__ == "__main__":
    main()
