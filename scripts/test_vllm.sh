#!/usr/bin/env bash
# Build .venv-vllm (scripts/vllm_env.sh) and run the vLLM plugin's test suite in it (real CPU engines: SmolLM2, and
# Qwen2.5-Coder-0.5B for tensor parallelism 2: 16 engine starts, 5-9 min of test time; pass -m "not slow" to leave
# it out). The longest file is test_vllm_tensor_parallel.py (Qwen2.5-Coder-0.5B cut to 4 layers over 2 ranks).
# CI runs `bash scripts/test_vllm.sh -n 2 --dist loadfile`: the files in 2 processes (pytest-xdist), each engine on one
# thread, the longest files first (--no-loadscope-reorder, see tests/vllm/conftest.py); it took 10 min on 2 idle
# cores (193 tests; longer under other jobs' load). On a shared machine, -n 3 also works.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/vllm_env.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
"${VLLM_VENV:-.venv-vllm}/bin/python" -m pytest -q -p no:cacheprovider --no-loadscope-reorder tests/vllm "$@"
