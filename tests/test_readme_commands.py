"""Every `hf-concept` command the README shows parses with the real CLI, and every subcommand it shows is
run by a test (the table below names it), so the README cannot drift from the code unnoticed."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from hf_concept.cli import COMMANDS, build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
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
# How a README line starts an `hf-concept` command; the arguments follow.
LAUNCHERS = re.compile(
    r"^(?:\.venv/bin/)?hf-concept\s|^(?:torchrun|accelerate launch)\s.*?-m hf_concept\.cli\s"
)


def readme_commands() -> list[str]:
    """The `hf-concept` command lines of the README's shell blocks (continuations joined, comments cut)."""
    text = README.read_text(encoding="utf-8")
    commands = []
    for block in re.findall(r"```(?:sh|bash|console)\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if "&&" in line:
                line = line.split("&&")[-1].strip()
            if LAUNCHERS.match(line):
                commands.append(line)
    return commands


def arguments(command: str) -> list[str]:
    head = LAUNCHERS.match(command)
    return shlex.split(command[head.end() :])


def test_the_readme_shows_commands():
    shown = {arguments(command)[0] for command in readme_commands()}
    # The main job and the per-family quickstart steps are all in the README.
    assert {"demo", "convert", "train", "generate", "segment", "push"} <= shown, sorted(shown)


@pytest.mark.parametrize("command", readme_commands())
def test_readme_command_parses(command):
    try:
        build_parser().parse_args(arguments(command))
    except SystemExit as error:  # argparse reports unknown flags and bad values this way
        pytest.fail(f"README command does not parse (exit {error.code}): {command}")


def test_every_subcommand_is_run_by_a_test():
    assert set(RUN_BY) == set(COMMANDS), "a subcommand has no test listed in RUN_BY"
    for name, (path, marker) in RUN_BY.items():
        source = (ROOT / path).read_text(encoding="utf-8")
        assert marker in source, f"{path} does not run `hf-concept {name}`"
