"""The tree is ruff clean (lint and format), so CI catches style drift with the tests."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _ruff() -> list[str]:
    beside_python = Path(sys.executable).with_name("ruff")
    if beside_python.exists():
        return [str(beside_python)]
    found = shutil.which("ruff")
    assert found, "ruff is not installed: install the dev extra (pip install -e '.[dev]')"
    return [found]


def test_ruff_check():
    result = subprocess.run([*_ruff(), "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format():
    result = subprocess.run([*_ruff(), "format", "--check", "."], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
