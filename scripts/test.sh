#!/usr/bin/env bash
# Set up a virtual environment (VENV, default .venv), install boom-ml with its dev extras,
# lint, and run the test suite. This is the README's test command; .ci/run calls it.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -e '.[dev]'
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
"$VENV/bin/python" -m pytest -q "$@"
