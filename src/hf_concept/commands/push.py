"""`hf-concept push CHECKPOINT REPO_ID`: upload a checkpoint folder to the Hugging Face Hub.

The work is `hf_concept.hub.push_checkpoint`; this module maps flags onto it and prints. A checkpoint that
would not load (no config.json, no weights, weights cut short or not weights, a missing remote-code
module) or whose weights hold NaN or inf, a missing folder or a bad repo id prints one line to stderr and
exits 2 before anything is sent (`--dry-run` included). Notes (each symbolic link and its target, a card
kept as edited, no tokenizer) are printed before the upload, and in the dry-run listing. A failed
upload (no network, an HTTP error, no token, offline mode: `hub.is_hub_error`) prints one line naming the
repo and the cause and exits 1; the folder is then left as it was.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DESCRIPTION = (
    "Upload a checkpoint folder (weights, remote-code files, tokenizer, model card) to a Hub model repo."
)
EPILOG = """\
what is uploaded:
  every file under CHECKPOINT except hidden files and folders (.git/, .DS_Store, .gitattributes, ...),
  __pycache__/ and *.pyc, Trainer checkpoint-*/ and checkpoints/ folders (unless --include-checkpoints),
  and the training state a raw checkpoint-N folder holds beside the model (optimizer.pt, scheduler.pt,
  rng_state*.pth, scaler.pt, training_args.bin, trainer_state.json, run_settings.json; unless
  --include-training-state).
  push lists every entry it leaves out.
  The folder must hold config.json, the weights (model.safetensors, or an index and all its shards, or
  pytorch_model.bin), each file whole and every tensor finite (no NaN or inf), and, for remote code,
  every .py that auto_map names plus the modules they import with `from .x import`.

symbolic links:
  a link to a file is followed: its target's content is uploaded under the link's name, and push prints
  "note: LINK is a symbolic link to TARGET" for each one before anything is sent (and in --dry-run).
  A link to a folder is not followed and a broken link is not uploaded; both are listed as not uploaded.

model card:
  without a README.md, push writes one (hf_concept's card for the model family); a card that hf-concept
  wrote and nobody edited is rewritten so that its load snippet names REPO_ID. The new card is uploaded,
  then written into CHECKPOINT (push says so) only once the upload succeeded. Any other README.md is
  uploaded unchanged.

failures:
  a folder that would not load (weights cut short included), weights with NaN or inf, or a bad REPO_ID:
  one line naming the file, exit status 2, nothing sent (--dry-run fails the same way). No network, an
  HTTP error or no token: one line naming REPO_ID and the cause, exit status 1, CHECKPOINT unchanged.

token:
  --token, else the HF_TOKEN environment variable, else the token saved by `hf auth login`.
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "push",
        help="Upload a checkpoint folder to the Hugging Face Hub.",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("checkpoint", type=Path, help="Checkpoint folder (as written by save_pretrained).")
    parser.add_argument("repo_id", help="Model repo, 'namespace/name' (or 'name' in your own namespace).")
    parser.add_argument("--private", action="store_true", help="Create the repo private (if it is new).")
    parser.add_argument("--revision", default=None, help="Branch to commit to; created from main if missing.")
    parser.add_argument("--token", default=None, help="Hub token (default: HF_TOKEN or the saved login).")
    parser.add_argument("--commit-message", default=None, help="Commit title.")
    parser.add_argument(
        "--include-checkpoints",
        action="store_true",
        help="Also upload Trainer checkpoint-*/ and checkpoints/ folders.",
    )
    parser.add_argument(
        "--include-training-state",
        action="store_true",
        help="Also upload Trainer's optimizer, scheduler, RNG and trainer state files (to resume elsewhere).",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="List exactly what would be uploaded (bytes, path); send nothing.",
    )


def run(args: argparse.Namespace) -> int:
    from hf_concept import hub

    included = dict(
        include_checkpoints=args.include_checkpoints, include_training_state=args.include_training_state
    )
    try:
        # Validate before any network call, so a broken folder never creates an empty repo.
        plan = hub.plan_upload(args.checkpoint, args.repo_id, **included)
        if args.dry_run:
            print_plan(plan, args)
            return 0
    except (ValueError, FileNotFoundError, NotADirectoryError) as error:
        print(f"hf-concept push: error: {error}", file=sys.stderr)
        return 2
    # Before the upload: a symbolic link's target is about to leave the machine.
    for note in plan.notes:
        print(f"note: {note}")
    try:
        url = hub.push_checkpoint(
            args.checkpoint,
            args.repo_id,
            private=args.private,
            revision=args.revision,
            token=args.token,
            commit_message=args.commit_message,
            report=print,
            **included,
        )
    except Exception as error:
        # Network, HTTP, token and offline-mode failures are the user's to fix: one line. Anything else
        # is a bug of ours and keeps its traceback.
        if not hub.is_hub_error(error):
            raise
        message = hub.describe_hub_error(error)
        print(f"hf-concept push: error: upload to {args.repo_id!r} failed: {message}", file=sys.stderr)
        return 1
    print(f"pushed {args.checkpoint} to {url}")
    for entry in plan.skipped:
        print(f"not uploaded: {entry}")
    return 0


def print_plan(plan, args: argparse.Namespace) -> None:
    """The dry-run listing: one line per file (bytes, relative path), then the total and what is left out."""
    visibility = "private" if args.private else "public"
    branch = args.revision or "main"
    print(f"dry run: would upload to model repo {plan.repo_id} ({visibility} if created), branch {branch}:")
    card_notes = {
        "written": "  (model card written by push: the folder has none)",
        "rewritten": f"  (model card rewritten by push to load from {plan.repo_id})",
    }
    for path, size in plan.files:
        note = card_notes.get(plan.card_action, "") if path == "README.md" else ""
        print(f"{size:>12}  {path}{note}")
    print(f"{plan.total_bytes:>12}  total, {len(plan.files)} files")
    if plan.code_files:
        print(f"remote code: the {len(plan.code_files)} .py files that auto_map needs are all present")
    for entry in plan.skipped:
        print(f"not uploaded: {entry}")
    for note in plan.notes:
        print(f"note: {note}")
