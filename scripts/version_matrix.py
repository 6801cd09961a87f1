"""The transformers version matrix: the conformance suite and saved checkpoints across releases.

    python scripts/version_matrix.py [--releases 5.18.0 5.23.0 5.24.0] [--below 5.17.0] [--venvs DIR]

For each release in `--releases` (oldest supported, the previous pin, the newest tested) a virtual
environment is made under `--venvs` (default ~/.cache/hf_concept/version-matrix; reused when present):
torch 2.13.0 first, then this checkout with its test tools and `transformers==<release>`, all from the
package registry. Then:

1. the default test suite (what CI runs: conformance, compatibility, upgrade and the rest) runs under
   each release;
2. one tiny checkpoint per family is saved under the oldest and under the newest release, and each is
   loaded in an isolated process (`python -I`, `hf_concept` blocked: the remote code alone) under the
   other end of the range, and must generate the tokens it generated where it was saved;
3. the same checkpoints with the remote code of hf_concept before the compatibility layer (a folder
   saved by that version) generate under the release they were written for (`--legacy-release`), are
   upgraded with `hf-concept upgrade`, and must generate the same tokens under the oldest and the newest
   release;
4. under the release below the floor (`--below`) a checkpoint's code refuses to load in one line, and the
   suite, forced to run with HF_CONCEPT_IGNORE_TRANSFORMERS_RANGE=1, fails: the reason the floor is where
   it is (the distinct errors are printed).

It prints one line per check and a summary; the exit status is 0 only when every check holds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TORCH = "torch==2.13.0"
DEFAULT_VENVS = Path.home() / ".cache" / "hf_concept" / "version-matrix"


def log(message: str) -> None:
    print(message, flush=True)


def run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, **kwargs)


def make_venv(venvs: Path, release: str) -> Path:
    """The Python of a virtual environment with this checkout and transformers `release`."""
    folder = venvs / f"transformers-{release}"
    python = folder / "bin" / "python"
    if python.is_file() and run([str(python), "-c", "import hf_concept, transformers"]).returncode == 0:
        return python
    log(f"[{release}] making {folder}")
    shutil.rmtree(folder, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    # torch first: on these machines 2.13.0 is a local CPU wheel, any other resolution pulls CUDA.
    subprocess.run([*pip, TORCH], check=True)
    # The project's requirements but transformers, which is the release under test (also one below the
    # range pyproject.toml allows); then the checkout itself without dependencies.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + project["optional-dependencies"]["dev"]
    others = [item for item in requirements if not item.startswith("transformers")]
    subprocess.run([*pip, f"transformers=={release}", *others], check=True)
    subprocess.run([*pip, "--no-deps", "-e", str(ROOT)], check=True)
    return python


def versions(python: Path) -> str:
    code = (
        "import torch, transformers, peft, accelerate, datasets, trl; print(' '.join(f'{m.__name__} "
        "{m.__version__}' for m in (transformers, torch, peft, accelerate, datasets, trl)))"
    )
    return run([str(python), "-c", code]).stdout.strip()


def suite(python: Path, ignore_range: bool = False) -> tuple[bool, str, str]:
    """(passed, pytest's summary line, its output) of the default suite under `python`."""
    environment = {**os.environ}
    if ignore_range:
        environment["HF_CONCEPT_IGNORE_TRANSFORMERS_RANGE"] = "1"
    started = time.perf_counter()
    command = [str(python), "-m", "pytest", "-q", "-p", "no:randomly", "--tb=line"]
    result = run(command, cwd=ROOT, env=environment)
    lines = result.stdout.strip().splitlines()
    summary = lines[-1] if lines else result.stderr.strip()[-300:]
    return result.returncode == 0, f"{summary} [{time.perf_counter() - started:.0f} s]", result.stdout


def distinct_errors(output: str) -> list[str]:
    """The kinds of error a failed run shows, most frequent first (the reasons it fails)."""
    errors = re.findall(r"^/.*?: (\w+(?:Error|Exception): .*)$", output, flags=re.MULTILINE)
    counts: dict[str, int] = {}
    for error in errors:
        # Numbers differ from test to test; the kind of failure is what repeats.
        key = re.sub(r"\d+", "N", error)[:150]
        counts[key] = counts.get(key, 0) + 1
    return [f"{count} x {error}" for error, count in sorted(counts.items(), key=lambda item: -item[1])][:6]


def save_under(python: Path, folder: Path) -> dict[str, str]:
    code = (
        "import json, sys; from pathlib import Path; from tests.saved_checkpoints import save_checkpoints; "
        "print(json.dumps(save_checkpoints(Path(sys.argv[1]))))"
    )
    result = run([str(python), "-c", code, str(folder)], cwd=ROOT)
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def tokens_under(python: Path, folders: dict[str, str], workdir: Path) -> dict | str:
    """Greedy tokens of `folders` in an isolated process under `python`, or the error's last line."""
    from tests.saved_checkpoints import fresh_greedy

    result = fresh_greedy(folders, workdir, python=str(python))
    if result.returncode != 0:
        return result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "failed"
    return json.loads(result.stdout.strip().splitlines()[-1])


def refusal_below(python: Path, saved: dict[str, str], workdir: Path) -> str:
    from tests.saved_checkpoints import fresh_greedy

    result = fresh_greedy({"plain": saved["plain"]}, workdir, python=str(python))
    lines = [line for line in result.stderr.splitlines() if "ImportError" in line]
    return lines[-1] if result.returncode != 0 and lines else f"no refusal (status {result.returncode})"


class Checks:
    def __init__(self) -> None:
        self.results: list[tuple[bool, str]] = []

    def record(self, ok: bool, line: str) -> None:
        self.results.append((ok, line))
        log(f"{'PASS' if ok else 'FAIL'}  {line}")


def check_suites(checks: Checks, pythons: dict[str, Path]) -> None:
    for release, python in pythons.items():
        log(f"[{release}] {versions(python)}")
        ok, summary, _ = suite(python)
        checks.record(ok, f"suite under transformers {release}: {summary}")


def check_checkpoints(
    checks: Checks, pythons: dict[str, Path], ends: tuple[str, str], work: Path
) -> tuple[dict[str, str], dict | str]:
    references = {}
    saved = {}
    for release in ends:
        saved[release] = save_under(pythons[release], work / f"saved-{release}")
        references[release] = tokens_under(pythons[release], saved[release], work / f"gen-{release}")
        checks.record(isinstance(references[release], dict), f"saved under {release}, generates there")
    for source, target in ((ends[0], ends[1]), (ends[1], ends[0])):
        got = tokens_under(pythons[target], saved[source], work / f"gen-{source}-under-{target}")
        checks.record(
            got == references[source],
            f"saved under {source}, loaded under {target}: same tokens ({got!s:.80})",
        )
    return saved[ends[1]], references[ends[1]]


def check_legacy(checks: Checks, pythons: dict[str, Path], legacy_release: str, ends, saved, work) -> None:
    from tests.saved_checkpoints import legacy_copies

    legacy = legacy_copies(saved, work / "legacy")
    reference = tokens_under(pythons[legacy_release], legacy, work / "legacy-gen")
    checks.record(isinstance(reference, dict), f"legacy folders generate under {legacy_release}")
    newest = tokens_under(pythons[ends[1]], legacy, work / "legacy-newest")
    log(f"      legacy folders under {ends[1]} before the upgrade: {newest!s:.120}")
    for name, folder in legacy.items():
        result = run([str(pythons[ends[1]]), "-m", "hf_concept", "upgrade", folder], cwd=work)
        checks.record(result.returncode == 0, f"hf-concept upgrade {name}: {result.stdout.strip()[:100]}")
    for release in ends:
        got = tokens_under(pythons[release], legacy, work / f"upgraded-{release}")
        checks.record(got == reference, f"upgraded legacy folders under {release}: the tokens they had")


def check_below(checks: Checks, python: Path, release: str, saved, work: Path) -> None:
    refusal = refusal_below(python, saved, work / "below")
    checks.record("needs transformers>=" in refusal, f"a checkpoint under {release} refuses: {refusal}")
    ok, summary, output = suite(python, ignore_range=True)
    checks.record(not ok, f"suite under {release}, range check off, fails: {summary}")
    for error in distinct_errors(output):
        log(f"      {error[:170]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--releases", nargs="+", default=["5.18.0", "5.23.0", "5.24.0"])
    parser.add_argument("--below", default="5.17.0", help="A release below the floor ('' to skip).")
    parser.add_argument(
        "--legacy-release", default="5.23.0", help="What the legacy folders were saved under."
    )
    parser.add_argument(
        "--venvs", type=Path, default=Path.home() / ".cache" / "hf_concept" / "version-matrix"
    )
    args = parser.parse_args(argv)
    releases = sorted(set(args.releases) | {args.legacy_release}, key=lambda r: tuple(map(int, r.split("."))))
    pythons = {release: make_venv(args.venvs, release) for release in releases}
    ends = (releases[0], releases[-1])
    checks = Checks()
    check_suites(checks, {release: pythons[release] for release in args.releases})
    with tempfile.TemporaryDirectory(prefix="hf-concept-matrix-") as work:
        work = Path(work)
        saved, _ = check_checkpoints(checks, pythons, ends, work)
        check_legacy(checks, pythons, args.legacy_release, ends, saved, work)
        if args.below:
            check_below(checks, make_venv(args.venvs, args.below), args.below, saved, work)
    failed = [line for ok, line in checks.results if not ok]
    log(f"\n{len(checks.results) - len(failed)} of {len(checks.results)} checks hold")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
