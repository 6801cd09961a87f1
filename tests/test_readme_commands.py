"""Every `hf-concept` command that the README and the docs/ pages show parses with the real CLI, every
subcommand is shown somewhere and run by a test (the table below names it), the README's top block is
exactly CI's command, and every relative link of the README and the docs pages resolves, so the docs
cannot drift from the code unnoticed."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from hf_concept.cli import COMMANDS, build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
# docs/ARCHITECTURE.md has its own checker (tests/test_docs_architecture.py); its links are its own.
OWN_LINKS_CHECKED_ELSEWHERE = {DOCS / "ARCHITECTURE.md"}
# The README's first block, byte for byte: `.ci/run` runs its last line, and people copy it.
TOP_BLOCK = """```sh
# set everything up and run the main job
sh scripts/setup.sh && .venv/bin/hf-concept demo

# set everything up and run the test suite (what CI runs)
sh scripts/setup.sh && .venv/bin/python -m pytest
```
"""
# Subcommand -> (test file, text that file must contain: the call that runs the subcommand end to end).
RUN_BY = {
    "demo": ("tests/test_demo.py", '"demo"'),
    "convert": ("tests/test_convert_conceptmoe.py", '"convert"'),
    "expand": ("tests/test_convert_hidden_decoding.py", '"expand"'),
    "plan": ("tests/test_planning.py", '"plan"'),
    "compute": ("tests/test_compute.py", '"compute"'),
    "fit-scaling": ("tests/test_scaling.py", '"fit-scaling"'),
    "train": ("tests/test_train_command.py", '"train"'),
    "generate": ("tests/test_generate_command.py", '"generate"'),
    "segment": ("tests/test_segmentation.py", '"segment"'),
    "push": ("tests/test_push.py", '"push"'),
    "build-corpus": ("tests/test_corpus_builder.py", '"build-corpus"'),
    "upgrade": ("tests/test_upgrade.py", '"upgrade"'),
}
# How a shell line starts an `hf-concept` command; the arguments follow.
LAUNCHERS = re.compile(
    r"^(?:\.venv/bin/)?hf-concept\s|^(?:torchrun|accelerate launch)\s.*?-m hf_concept\.cli\s"
)
FENCED = re.compile(r"^```.*?^```[ \t]*$", flags=re.S | re.M)
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")


def pages() -> list[Path]:
    """The README and every page under docs/."""
    return [README, *sorted(DOCS.glob("*.md"))]


def shell_commands(path: Path) -> list[str]:
    """The `hf-concept` command lines of a page's shell blocks (continuations joined, comments cut)."""
    text = path.read_text(encoding="utf-8")
    commands = []
    for block in re.findall(r"```(?:sh|bash|console)\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if "&&" in line:
                line = line.split("&&")[-1].strip()
            if LAUNCHERS.match(line):
                commands.append(line)
    return commands


def documented_commands() -> list[tuple[str, str]]:
    """(page, command) for every `hf-concept` command line of the README and the docs pages."""
    return [(str(path.relative_to(ROOT)), command) for path in pages() for command in shell_commands(path)]


def readme_commands() -> list[str]:
    """The `hf-concept` command lines of the README's shell blocks."""
    return shell_commands(README)


def arguments(command: str) -> list[str]:
    head = LAUNCHERS.match(command)
    return shlex.split(command[head.end() :])


def test_the_readme_shows_commands():
    shown = {arguments(command)[0] for command in readme_commands()}
    # The main job (the top block) and the quickstart: convert, train, generate.
    assert {"demo", "convert", "train", "generate"} <= shown, sorted(shown)


def test_the_docs_show_every_subcommand():
    shown = {arguments(command)[0] for _, command in documented_commands()}
    assert set(COMMANDS) <= shown, f"shown nowhere: {sorted(set(COMMANDS) - shown)}"


@pytest.mark.parametrize(("page", "command"), documented_commands())
def test_readme_command_parses(page, command):
    try:
        build_parser().parse_args(arguments(command))
    except SystemExit as error:  # argparse reports unknown flags and bad values this way
        pytest.fail(f"{page}: command does not parse (exit {error.code}): {command}")


def test_every_subcommand_is_run_by_a_test():
    assert set(RUN_BY) == set(COMMANDS), "a subcommand has no test listed in RUN_BY"
    for name, (path, marker) in RUN_BY.items():
        source = (ROOT / path).read_text(encoding="utf-8")
        assert marker in source, f"{path} does not run `hf-concept {name}`"


def test_the_readme_top_block_is_what_ci_runs():
    """`.ci/run` runs the README's test command; the README's first block shows it, unchanged."""
    text = README.read_text(encoding="utf-8")
    assert text.find(TOP_BLOCK) == text.find("```"), "the README's first block is not the setup/test block"
    assert text.find(TOP_BLOCK) < text.find("\n## "), "the setup/test block is not at the README's top"
    ci_lines = [
        line.strip()
        for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert ci_lines[-1] in TOP_BLOCK.splitlines(), f".ci/run runs {ci_lines[-1]!r}, not the README's command"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCED.sub("", path.read_text(encoding="utf-8"))
    return {slug(line.lstrip("#")) for line in text.splitlines() if re.match(r"#{1,6} ", line)}


def link_problems(path: Path) -> list[str]:
    """Every relative link of a page (outside code) that names a missing file or heading."""
    text = re.sub(r"`[^`\n]*`", "", FENCED.sub("", path.read_text(encoding="utf-8")))
    name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    problems = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            problems.append(f"{name}: {target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            problems.append(f"{name}: {target} (no such heading)")
    return problems


def test_relative_links_resolve():
    problems = [
        problem
        for path in pages()
        if path not in OWN_LINKS_CHECKED_ELSEWHERE
        for problem in link_problems(path)
    ]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_link_checker_catches_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other\n\n## A `code` heading / here\n", encoding="utf-8")
    page.write_text(
        "[ok](other.md#a-code-heading--here) [file](missing.md) [anchor](other.md#nowhere)\n"
        "`[not a link](missing.md)`\n```\n[in code](missing.md)\n```\n",
        encoding="utf-8",
    )
    problems = link_problems(page)
    assert len(problems) == 2 and "missing.md" in problems[0] and "nowhere" in problems[1], problems
