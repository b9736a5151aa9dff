#!/usr/bin/env bash
# Set up .venv and run the whole test suite (unit tests on tiny models + a few SmolLM2 integration tests), its test
# files spread over KVCOMPRESS_TEST_WORKERS processes (pytest-xdist; default 2, one torch thread each; 1: one
# process). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
WORKERS="${KVCOMPRESS_TEST_WORKERS:-2}"
case "$WORKERS" in
  '' | *[!0-9]* | 0) echo "KVCOMPRESS_TEST_WORKERS=$WORKERS: expected a whole number of processes, 1 or more" >&2; exit 2 ;;
esac
bash scripts/setup.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
.venv/bin/python -m ruff check src tests experiments scripts examples
if [ "$WORKERS" -gt 1 ]; then
  set -- -n "$WORKERS" --dist loadfile "$@"
fi
.venv/bin/python -m pytest -q "$@"
