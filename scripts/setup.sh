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
# The newest transformers release the version matrix passed (pyproject.toml allows the tested range): a
# release that appears tomorrow cannot change what the suite runs against. scripts/version_matrix.py
# runs the older ends of the range.
TESTED_TRANSFORMERS=5.24.0
.venv/bin/python -m pip install --quiet -e ".[dev]" "transformers==$TESTED_TRANSFORMERS"
# `hf-concept build-corpus` and its test run groff (man pages) and Rscript (Austen's novels are R data).
if ! command -v groff >/dev/null 2>&1 || ! command -v Rscript >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends groff-base r-base-core >/dev/null
    else
        echo "setup.sh: build-corpus needs groff and Rscript: run" \
            "\`apt-get install -y --no-install-recommends groff-base r-base-core\` as root" >&2
    fi
fi
