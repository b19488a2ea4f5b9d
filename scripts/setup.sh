#!/usr/bin/env bash
# Create .venv and install Duet with its test extras. torch goes first: the CPU build of 2.13.0 is on the
# machine's local disk, and a bare `torch` requirement would otherwise pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e ".[test,bench]"
