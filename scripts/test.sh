#!/usr/bin/env bash
# Set up .venv and run the whole test suite (unit tests on tiny models + a few SmolLM2 integration tests).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
.venv/bin/python -m ruff check src tests experiments scripts examples
.venv/bin/python -m pytest -q "$@"
