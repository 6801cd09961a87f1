"""Share a checkpoint folder on the Hugging Face Hub: validate it, plan the upload, push it.

What gets uploaded (`files_to_upload`): every file under the folder except
- hidden files and folders (a name starting with "."): `.git/`, `.DS_Store`, `.ipynb_checkpoints/`,
  `.cache/`, `.gitattributes` (the Hub keeps its own), and the staging folders of an interrupted write;
- `__pycache__/` folders and compiled `*.pyc` / `*.pyo` files;
- `Trainer` checkpoint folders (`checkpoint-*/`, and `checkpoints/` where `hf-concept train` keeps them, at
  the top level), unless `include_checkpoints=True`;
- `Trainer`'s training state at the top level (`optimizer.pt`, `scheduler.pt`, `rng_state*.pth`,
  `scaler.pt`, `training_args.bin`, `trainer_state.json`, DeepSpeed's `global_step*/`, and the
  `run_settings.json` that `hf-concept train` records for resuming), which
  `from_pretrained` never reads and a raw `checkpoint-N` folder holds, unless
  `include_training_state=True`.

These rules are `HfApi.upload_folder`'s `ignore_patterns` (`upload_ignore_patterns`), applied by
huggingface_hub's own matcher (`filter_repo_objects`), so `upload_folder(..., ignore_patterns=
upload_ignore_patterns())` selects the same files. The walk here adds what the library does not give:
the listing of what was left out, each top-most entry once, with its reason.

Before anything leaves the machine, `check_checkpoint` insists on a loadable checkpoint: `config.json`;
weights (`model.safetensors`, or an index with every shard it names, or `pytorch_model.bin`), each file
whole (a safetensors file as long as its header says, a `.bin` a complete archive) and every floating
tensor finite (NaN or inf weights load and then give NaN outputs); and for remote-code model types every
module named in the `auto_map` of `config.json` and `tokenizer_config.json` plus every sibling those
import with `from .x import` (the files `from_pretrained` will ask for).

Symbolic links: a link to a file is followed (its target's content is uploaded under the link's name,
as `upload_folder` does), and the plan carries a note naming each link and its target, so that a link
out of the folder is never uploaded unseen. A link to a folder is not followed, and a broken link is
not uploaded; both are listed with what is left out.

The model card: a folder without `README.md` gets one rendered by `model_card.render_model_card`. A card
that `hf_concept` wrote and nobody edited since is rewritten so that its load snippet names the repo
instead of a local path. Any other card is uploaded as it is. A new card is uploaded from memory and
written into the folder (and reported) only once the commit has landed, so that the local folder and
the repo stay the same: a failed push leaves every file of the folder as it was.

The upload is `HfApi.create_repo(exist_ok=True)`, `create_branch(exist_ok=True)` when a revision other
than main is asked for, then one `create_commit` with a `CommitOperationAdd` per planned file (not
`upload_folder`, which can only send files on disk: a new model card goes from memory, see above). `HfApi`
can be injected, which is how the tests run offline. `is_hub_error` tells a failed Hub call (network,
HTTP, token, offline mode) from a bug, and `describe_hub_error` says it in one line.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import pickle
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

from huggingface_hub import CommitOperationAdd, HfApi
from huggingface_hub.utils import filter_repo_objects

logger = logging.getLogger(__name__)

WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
# What Trainer (and `train`'s record of its settings) writes beside the model in checkpoint-N: resuming
# needs it, from_pretrained does not.
TRAINING_STATE_FILES = (
    "optimizer.pt",
    "scheduler.pt",
    "scaler.pt",
    "training_args.bin",
    "trainer_state.json",
    "run_settings.json",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


@dataclass
class UploadPlan:
    """What `push_checkpoint` would do: the files (relative POSIX path, size in bytes), in upload order,
    the model-card action ("kept", "written" or "rewritten") with the new card text, and notes."""

    folder: Path
    repo_id: str
    files: list[tuple[str, int]]
    code_files: list[str]
    card_action: str = "kept"
    card_text: str | None = None
    skipped: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size in self.files)


@dataclass(frozen=True)
class SkipRule:
    """Entries an upload leaves out: `patterns` in `HfApi.upload_folder`'s `ignore_patterns` syntax
    (relative POSIX paths; a trailing "/" means everything under a folder; `*` also matches "/"), and the
    reason the listing gives."""

    patterns: tuple[str, ...]
    reason: str


HIDDEN = SkipRule((".*", "*/.*"), "hidden")
PYTHON_CACHE = SkipRule(("__pycache__/", "*/__pycache__/"), "Python cache")
COMPILED = SkipRule(("*.pyc", "*.pyo"), "compiled Python")
# Patterns without a leading "*/" match at the top level only. `hf-concept train` keeps Trainer's
# checkpoints in `checkpoints/`; DeepSpeed's go into `global_step*/`.
CHECKPOINTS = SkipRule(
    ("checkpoint-*/", "checkpoints/"), "Trainer checkpoint; pass --include-checkpoints to upload it"
)
TRAINING_STATE = SkipRule(
    (*TRAINING_STATE_FILES, "rng_state*.pth", "global_step*/"),
    "training state, not read by from_pretrained; pass --include-training-state to upload it",
)


def skip_rules(*, include_checkpoints: bool = False, include_training_state: bool = False) -> list[SkipRule]:
    """The rules in force, in the order a left-out entry's reason is looked up."""
    rules = [HIDDEN, PYTHON_CACHE, COMPILED]
    if not include_checkpoints:
        rules.append(CHECKPOINTS)
    if not include_training_state:
        rules.append(TRAINING_STATE)
    return rules


def upload_ignore_patterns(
    *, include_checkpoints: bool = False, include_training_state: bool = False
) -> list[str]:
    """`ignore_patterns` for `HfApi.upload_folder` that select the files `files_to_upload` lists."""
    rules = skip_rules(include_checkpoints=include_checkpoints, include_training_state=include_training_state)
    return [pattern for rule in rules for pattern in rule.patterns]


def _skip_reason(path: str, rules: list[SkipRule]) -> str | None:
    """Why the entry at relative POSIX `path` (a folder's ends with "/") is left out; None: it is not."""
    for rule in rules:
        if any(filter_repo_objects([path], allow_patterns=list(rule.patterns))):
            return rule.reason
    return None


def scan_folder(
    folder: str | Path, *, include_checkpoints: bool = False, include_training_state: bool = False
) -> tuple[list[Path], list[str]]:
    """(files to upload as relative paths, sorted; "path (reason)" for each top-most entry left out).

    A folder is matched as "path/", so a folder pattern leaves it out whole and it is listed once; the
    files uploaded are those `filter_repo_objects` keeps under `upload_ignore_patterns`. Links to folders
    (not followed) and broken links are listed as left out."""
    folder = Path(folder)
    rules = skip_rules(include_checkpoints=include_checkpoints, include_training_state=include_training_state)
    files: list[Path] = []
    skipped: list[str] = []
    for root, dirs, names in os.walk(folder):
        base = Path(root).relative_to(folder)
        for name in sorted(dirs):
            path = f"{(base / name).as_posix()}/"
            reason = _skip_reason(path, rules)
            if reason is None and (Path(root) / name).is_symlink():
                # os.walk does not descend into it either: say so rather than drop it silently.
                reason = f"symbolic link to the folder {os.path.realpath(Path(root) / name)}, not followed"
            if reason:
                dirs.remove(name)
                skipped.append(f"{path} ({reason})")
        for name in names:
            path = (base / name).as_posix()
            reason = _skip_reason(path, rules)
            entry = Path(root) / name
            if reason is None and not entry.is_file():
                is_link = entry.is_symlink()
                reason = f"broken symbolic link to {os.readlink(entry)}" if is_link else "not a regular file"
            if reason:
                skipped.append(f"{path} ({reason})")
            else:
                files.append(base / name)
    return sorted(files, key=lambda path: path.as_posix()), sorted(skipped)


def files_to_upload(
    folder: str | Path, *, include_checkpoints: bool = False, include_training_state: bool = False
) -> list[Path]:
    """The files of `folder` that an upload sends, as paths relative to it (see the module docstring)."""
    included = dict(include_checkpoints=include_checkpoints, include_training_state=include_training_state)
    return scan_folder(folder, **included)[0]


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path.name} in {str(path.parent)!r} is not valid JSON: {error}") from error
    if not isinstance(data, dict):
        raise ValueError(f"{path.name} in {str(path.parent)!r} is not a JSON object")
    return data


def check_checkpoint(folder: str | Path) -> list[str]:
    """Raise for a folder that would not load from the Hub; return the remote-code files it needs.

    FileNotFoundError / NotADirectoryError for a missing folder; ValueError (one line, naming the file)
    for no config.json, no weights, a shard missing from an index, or a missing remote-code module."""
    folder = Path(folder)
    if not folder.exists():
        raise FileNotFoundError(f"checkpoint folder {str(folder)!r} does not exist")
    if not folder.is_dir():
        raise NotADirectoryError(f"checkpoint {str(folder)!r} is not a folder")
    if not (folder / "config.json").is_file():
        hint = ""
        if (folder / "adapter_config.json").is_file():
            hint = (
                " (it holds a PEFT adapter: merge it with merge_and_unload() and save_pretrained the model)"
            )
        raise ValueError(f"no config.json in {str(folder)!r}{hint}")
    config = _read_json(folder / "config.json")
    _check_weights(folder)
    return required_code_files(folder, config)


def _check_weights(folder: Path) -> None:
    """Raise naming the file when the weights are missing, cut short, not weights, or not finite."""
    for path in _weight_paths(folder):
        problem = _weight_file_problem(str(path.resolve()), *_file_stamp(path))
        if problem:
            raise ValueError(f"checkpoint {str(folder)!r}: {problem}")


def _weight_paths(folder: Path) -> list[Path]:
    """The weight files `from_pretrained` reads: an index's shards (each present), else the single file."""
    for index_name in WEIGHT_INDEXES:
        if (folder / index_name).is_file():
            weight_map = _read_json(folder / index_name).get("weight_map") or {}
            for shard in sorted(set(weight_map.values())):
                if not (folder / shard).is_file():
                    raise ValueError(f"{index_name} names {shard}, which is missing from {str(folder)!r}")
            if weight_map:
                return [folder / shard for shard in sorted(set(weight_map.values()))]
    for name in WEIGHT_FILES:
        if (folder / name).is_file():
            return [folder / name]
    raise ValueError(
        f"no weights in {str(folder)!r}: expected model.safetensors, or model.safetensors.index.json "
        "with its shards, or pytorch_model.bin"
    )


def _file_stamp(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


@lru_cache(maxsize=64)
def _weight_file_problem(path: str, size: int, mtime_ns: int) -> str | None:
    """Why the weight file at `path` would not load or holds NaN/inf (None: it is fine). Cached on the
    file's size and time, as a push plans twice and every tensor is read."""
    import torch
    from safetensors import SafetensorError, safe_open

    from hf_concept.training.checkpoints import safetensors_problem

    weights = Path(path)
    unloadable = "the checkpoint would not load; save the model again with save_pretrained"
    try:
        if weights.suffix == ".safetensors":
            problem = safetensors_problem(weights)
            if problem:
                return f"{problem}: {unloadable}"
            with safe_open(path, framework="pt") as handle:
                tensors = ((key, handle.get_tensor(key)) for key in handle.keys())  # noqa: SIM118
                found = _first_non_finite(weights.name, tensors)
        else:
            # mmap needs torch.save's zip format; a legacy pickle file (or a cut-short zip) loads without.
            mmap = zipfile.is_zipfile(path)
            state_dict = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
            if not isinstance(state_dict, dict):
                return f"{weights.name} holds a {type(state_dict).__name__}, not a state dict: {unloadable}"
            found = _first_non_finite(weights.name, state_dict.items())
    except (SafetensorError, RuntimeError, OSError, EOFError, pickle.UnpicklingError, ValueError) as error:
        first_line = (str(error).splitlines() or [type(error).__name__])[0]
        return f"{weights.name} could not be read ({type(error).__name__}: {first_line}): {unloadable}"
    if found:
        return f"{found}: the model would give NaN outputs; push an earlier checkpoint with finite weights"
    return None


def _first_non_finite(file_name: str, tensors: Iterable[tuple[str, Any]]) -> str | None:
    """ "FILE: tensor NAME holds NaN or inf values" for the first floating tensor that does, else None."""
    import torch

    for name, tensor in tensors:
        if not (isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and tensor.numel()):
            continue
        # aminmax reads the tensor once (no full-size temporary) and returns NaN or inf if any is there;
        # it has no kernel for the float8 types.
        values = tensor if tensor.itemsize >= 2 else tensor.float()
        low, high = torch.aminmax(values)
        if not (torch.isfinite(low) and torch.isfinite(high)):
            return f"{file_name}: tensor {name!r} holds NaN or inf values"
    return None


def auto_map_modules(folder: Path, config: dict) -> list[tuple[str, str]]:
    """(module name, where it is named) for each local module in the auto_maps of the checkpoint.

    A reference of the form "other/repo--module.Class" lives in another repo and is not checked."""
    sources = [("config.json", config)]
    if (folder / "tokenizer_config.json").is_file():
        sources.append(("tokenizer_config.json", _read_json(folder / "tokenizer_config.json")))
    modules: dict[str, str] = {}
    for file_name, data in sources:
        for auto_class, reference in (data.get("auto_map") or {}).items():
            references = reference if isinstance(reference, list | tuple) else [reference]
            for item in references:
                if isinstance(item, str) and "--" not in item and "." in item:
                    named_by = f"{file_name} auto_map[{auto_class!r}] names it"
                    modules.setdefault(item.rsplit(".", 1)[0], named_by)
    return list(modules.items())


def code_closure(directory: Path, named: list[tuple[str, str]], skip_missing: bool = False) -> list[str]:
    """File names of the modules `named` ((module, who names it)) in `directory` and, recursively, of the
    siblings they import with `from .x import` (found the way transformers finds them). ValueError naming
    a missing file and who needs it, unless `skip_missing` (then it is left out)."""
    from transformers.dynamic_module_utils import get_relative_imports

    pending = [(f"{module}.py", named_by) for module, named_by in named]
    found: set[str] = set()
    while pending:
        file_name, named_by = pending.pop()
        if file_name in found:
            continue
        if not (directory / file_name).is_file():
            if skip_missing:
                continue
            raise ValueError(f"{file_name} is missing from {str(directory)!r}: {named_by}")
        found.add(file_name)
        for module in get_relative_imports(str(directory / file_name)):
            pending.append((f"{module}.py", f"{file_name} imports it (from .{module} import ...)"))
    return sorted(found)


def required_code_files(folder: str | Path, config: dict | None = None) -> list[str]:
    """The .py files `from_pretrained(..., trust_remote_code=True)` reads from the checkpoint: the modules
    in the auto_maps and the siblings they import (`code_closure`). ValueError naming the missing file
    and who needs it."""
    folder = Path(folder)
    config = _read_json(folder / "config.json") if config is None else config
    return code_closure(folder, auto_map_modules(folder, config))


def validate_hub_repo_id(repo_id: str) -> None:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise ValueError(f"repo_id={repo_id!r} is not a Hub repo id: {error}") from None


def plan_upload(
    folder: str | Path,
    repo_id: str,
    *,
    include_checkpoints: bool = False,
    include_training_state: bool = False,
) -> UploadPlan:
    """Validate `folder` and `repo_id` and describe the upload, without touching the folder or the Hub."""
    validate_hub_repo_id(repo_id)
    folder = Path(folder)
    code_files = check_checkpoint(folder)
    included = dict(include_checkpoints=include_checkpoints, include_training_state=include_training_state)
    paths, skipped = scan_folder(folder, **included)
    action, card_text, card_note = _card_action(folder, repo_id)
    sizes = {path.as_posix(): (folder / path).stat().st_size for path in paths}
    if card_text is not None:
        sizes["README.md"] = len(card_text.encode("utf-8"))
    plan = UploadPlan(folder, repo_id, sorted(sizes.items()), code_files, action, card_text, skipped)
    if card_note:
        plan.notes.append(card_note)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        plan.notes.append("no tokenizer files in the folder: users will need the base model's tokenizer")
    plan.notes += symlink_notes(folder, paths)
    return plan


def symlink_notes(folder: Path, paths: list[Path]) -> list[str]:
    """One note per planned file that is a symbolic link, naming the link and the file it resolves to."""
    notes = []
    for path in paths:
        if (folder / path).is_symlink():
            target = os.path.realpath(folder / path)
            notes.append(
                f"{path.as_posix()} is a symbolic link to {target}: that file's content is uploaded as "
                f"{path.as_posix()}"
            )
    return notes


def _card_action(folder: Path, repo_id: str) -> tuple[str, str | None, str | None]:
    """("kept" | "written" | "rewritten", new card text or None, a note or None)."""
    from hf_concept.model_card import previous_card_record, render_model_card

    path = folder / "README.md"
    if not path.is_file():
        return "written", str(render_model_card(folder, name_or_path=repo_id)), None
    record = previous_card_record(folder)
    if record is None or record.get("load_id") in (None, repo_id):
        return "kept", None, None
    untouched = str(render_model_card(folder, name_or_path=record["load_id"]))
    if path.read_text(encoding="utf-8") != untouched:
        note = "README.md was edited after hf_concept wrote it: kept as is"
        note += f" (its load snippet names {record['load_id']!r})"
        return "kept", None, note
    return "rewritten", str(render_model_card(folder, name_or_path=repo_id)), None


def apply_card(plan: UploadPlan, report: Callable[[str], None] | None = None) -> None:
    """Write the planned model card into the folder, saying so (push calls it once the commit landed).

    The repo has the card already, so a folder that cannot be written is reported, not raised."""
    if plan.card_text is None:
        return
    report = report or logger.warning
    path = plan.folder / "README.md"
    try:
        path.write_text(plan.card_text, encoding="utf-8")
    except OSError as error:
        report(f"the model card is in {plan.repo_id!r} but could not be written to {path}: {error}")
        return
    what = "wrote a model card" if plan.card_action == "written" else "rewrote the model card"
    report(f"{what} at {path} (its load snippet names {plan.repo_id!r})")


def commit_operations(plan: UploadPlan) -> list[CommitOperationAdd]:
    """One `CommitOperationAdd` per planned file; a new model card is sent from memory (`plan.card_text`),
    so the folder itself is not touched before the upload succeeds."""
    operations = []
    for path, _ in plan.files:
        if path == "README.md" and plan.card_text is not None:
            content: str | bytes = plan.card_text.encode("utf-8")
        else:
            content = str(plan.folder / path)
        operations.append(CommitOperationAdd(path_in_repo=path, path_or_fileobj=content))
    return operations


def _require_token(token: str | None) -> None:
    """Fail before any request when no token is configured (the Hub would refuse the upload anyway)."""
    from huggingface_hub import get_token
    from huggingface_hub.errors import LocalTokenNotFoundError

    if token is None and get_token() is None:
        raise LocalTokenNotFoundError(
            "no Hub token: pass one (--token), set HF_TOKEN, or log in with `hf auth login`"
        )


def push_checkpoint(
    folder: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    token: str | None = None,
    commit_message: str | None = None,
    api: HfApi | None = None,
    include_checkpoints: bool = False,
    include_training_state: bool = False,
    report: Callable[[str], None] | None = None,
) -> str:
    """Upload the checkpoint in `folder` to the model repo `repo_id` in one commit; returns its URL.

    The folder is validated first (nothing is created on the Hub for a broken checkpoint) and is written
    to only after the commit succeeded (a new model card, see `apply_card`). `private` applies when the
    repo is created (an existing repo keeps its visibility). `revision` names a branch, created from main
    when missing. `token`: None uses HF_TOKEN or the cached `hf auth login`; without `api` a missing
    token raises `LocalTokenNotFoundError` before any request. `report` receives the one-line messages
    about the model card (default: a logging warning). Network and Hub failures propagate (see
    `is_hub_error`)."""
    included = dict(include_checkpoints=include_checkpoints, include_training_state=include_training_state)
    plan = plan_upload(folder, repo_id, **included)
    if api is None:
        _require_token(token)
        api = HfApi(token=token)
    repo_url = api.create_repo(
        repo_id=repo_id, private=private, exist_ok=True, repo_type="model", token=token
    )
    # A bare name gets the caller's namespace; the card and the upload use the full id.
    full_id = getattr(repo_url, "repo_id", None) or repo_id
    if full_id != repo_id:
        plan = plan_upload(folder, full_id, **included)
    if revision and revision != "main" and not revision.startswith("refs/"):
        api.create_branch(repo_id=full_id, branch=revision, exist_ok=True, repo_type="model", token=token)
    family = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8")).get("model_type")
    commit = api.create_commit(
        repo_id=full_id,
        operations=commit_operations(plan),
        commit_message=commit_message or f"Upload {family} checkpoint with hf-concept push",
        revision=revision,
        repo_type="model",
        token=token,
    )
    apply_card(plan, report)
    return str(getattr(commit, "commit_url", None) or commit)


@cache
def hub_error_types() -> tuple[type[BaseException], ...]:
    """The exception families of a failed Hub call.

    OSError covers huggingface_hub's HTTP errors (`HfHubHTTPError` and its subclasses), offline mode,
    a missing token, hf_xet's authentication error, requests' errors and socket errors. The HTTP
    client's own errors (`httpx2` for huggingface_hub 2, `httpx` for 1: connect, timeout, protocol
    errors and invalid URLs) are not OSErrors; `HFValidationError` is a ValueError."""
    from huggingface_hub.errors import HFValidationError

    types: list[type[BaseException]] = [OSError, HFValidationError]
    for client in ("httpx2", "httpx"):
        try:
            module = importlib.import_module(client)
        except ImportError:
            continue
        types += [module.HTTPError, module.InvalidURL]
    return tuple(types)


def _error_chain(error: BaseException) -> list[BaseException]:
    chain = [error]
    while chain[-1].__cause__ is not None and len(chain) < 10:
        chain.append(chain[-1].__cause__)
    return chain


def is_hub_error(error: BaseException) -> bool:
    """True for a network, HTTP, token or offline-mode failure, also when huggingface_hub re-raised it
    wrapped (a failed LFS upload becomes `RuntimeError("Error while uploading ...") from error`)."""
    return any(isinstance(link, hub_error_types()) for link in _error_chain(error))


def describe_hub_error(error: BaseException) -> str:
    """One line: each error of the `raise ... from` chain down to the Hub error, with its type, and the
    request a connection error was making."""
    parts = []
    for link in _error_chain(error):
        lines = [line.strip() for line in str(link).splitlines() if line.strip()]
        part = f"{type(link).__name__}: {lines[0]}" if lines else type(link).__name__
        try:
            request = link.request  # httpx errors raise RuntimeError when no request is attached
        except (AttributeError, RuntimeError):
            request = None
        if request is not None and str(request.url) not in part:
            part += f" ({request.method} {request.url})"
        parts.append(part)
        if isinstance(link, hub_error_types()):
            break
    return ": ".join(parts)
