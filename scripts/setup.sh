#!/bin/sh
# Creates .venv (if missing) and installs hf_concept with its test tools.
# torch==2.13.0 goes first: on these machines it is a local CPU wheel, while any other resolution of
# "torch" pulls several GB of CUDA packages.
set -eu
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -e ".[dev]"
