"""The `hf-concept` command line.

Each subcommand lives in `hf_concept.commands.<name>` and registers itself through `add_parser`; the
heavy imports (torch, transformers) happen only when a subcommand runs, so `--help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from hf_concept import __version__

# Subcommand name -> module under hf_concept.commands exposing `add_parser(subparsers)` and `run(args)`.
COMMANDS = {
    "demo": "hf_concept.commands.demo",
    "convert": "hf_concept.commands.convert",
    "expand": "hf_concept.commands.expand",
    "fit-scaling": "hf_concept.commands.fit_scaling",
    "plan": "hf_concept.commands.plan",
    "compute": "hf_concept.commands.compute",
    "train": "hf_concept.commands.train",
    "generate": "hf_concept.commands.generate",
    "segment": "hf_concept.commands.segment",
    "push": "hf_concept.commands.push",
    "upgrade": "hf_concept.commands.upgrade",
    "build-corpus": "hf_concept.commands.build_corpus",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-concept",
        description="Convert, train, generate with and share concept-level and multi-stream language models.",
    )
    parser.add_argument("--version", action="version", version=f"hf-concept {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in COMMANDS.values():
        importlib.import_module(module_name).add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    module = importlib.import_module(COMMANDS[args.command])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
