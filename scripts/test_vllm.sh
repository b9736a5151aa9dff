#!/usr/bin/env bash
# Build .venv-vllm (scripts/vllm_env.sh) and run the vLLM plugin's test suite in it (real CPU engines: SmolLM2, and
# Qwen2.5-Coder-0.5B for tensor parallelism 2, the slow test: 16 engine starts, 15-30 min on 2 loaded cores;
# pass -m "not slow" to leave it out). On a shared machine, `bash scripts/test_vllm.sh -n 3 --dist loadfile` runs the
# test files in 3 processes (pytest-xdist), each engine still on one thread.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/vllm_env.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
"${VLLM_VENV:-.venv-vllm}/bin/python" -m pytest -q -p no:cacheprovider tests/vllm "$@"
