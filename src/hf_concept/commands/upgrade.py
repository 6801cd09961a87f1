"""`hf-concept upgrade FOLDER`: rewrite a saved checkpoint's remote code to this version's.

A folder saved by an earlier version carries that version's modeling code, which transformers runs as it
is: after a transformers release renames what the code uses, the folder loads again once upgraded. The
weights, the config and every other file are kept; the rewrite is atomic (`hf_concept.upgrade`). A folder
that is not an hf_concept checkpoint is refused with one line and exit status 2, and nothing is written.
`--dry-run` prints the plan only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "upgrade",
        help="Rewrite a saved checkpoint's remote code to this version of hf_concept.",
        description="Replace the modeling code a saved folder carries with this version's (weights, config "
        "and other files untouched), so that it loads under the transformers releases this version "
        "supports. Atomic: the folder is swapped only once the new one is complete.",
    )
    parser.add_argument("folder", type=Path, help="A folder written by save_pretrained or hf-concept.")
    parser.add_argument("--dry-run", action="store_true", help="Print what would change; write nothing.")


def run(args: argparse.Namespace) -> int:
    from hf_concept.upgrade import UpgradeError, plan_upgrade, upgrade_folder

    try:
        plan = plan_upgrade(args.folder) if args.dry_run else upgrade_folder(args.folder)
    except (UpgradeError, OSError) as error:
        print(f"hf-concept upgrade: error: {error}", file=sys.stderr)
        return 2
    if not plan.changes:
        print(f"{args.folder}: the remote code is already this version's ({len(plan.unchanged)} files)")
        return 0
    verb = "would change" if args.dry_run else "upgraded"
    print(f"{args.folder}: {verb} the remote code (weights and config untouched)")
    for label, names in (("replaced", plan.replaced), ("added", plan.added), ("removed", plan.removed)):
        if names:
            print(f"  {label}: {', '.join(names)}")
    return 0
