"""The console script answers --help and --version without heavy imports failing."""

import subprocess
import sys

from hf_concept import __version__


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hf_concept", *args], capture_output=True, text=True, timeout=120
    )


def test_version():
    result = _cli("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"hf-concept {__version__}"


def test_help_lists_subcommands():
    result = _cli("--help")
    assert result.returncode == 0, result.stderr
    assert "demo" in result.stdout


def test_unknown_subcommand_fails_clearly():
    result = _cli("frobnicate")
    assert result.returncode != 0
    assert "invalid choice" in result.stderr
