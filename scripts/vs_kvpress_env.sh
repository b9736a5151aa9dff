#!/usr/bin/env bash
# Build the separate environment for the kvpress side-by-side comparison (docs/vs-kvpress.md). Idempotent.
#
#   bash scripts/vs_kvpress_env.sh            # creates $KVPRESS_VENV (default /work/kvpress-venv)
#
# kvpress 0.5.5 pins transformers<5.3 (kvcompress needs 5.23), so it cannot live in kvcompress's environment;
# the two sides exchange samples and results as JSON files and never import each other.
set -euo pipefail
VENV="${KVPRESS_VENV:-/work/kvpress-venv}"
PYTHON="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
# The CPU build of torch first: a bare `torch` requirement (kvpress asks for torch<3) would pull a CUDA build.
$PIP install "torch==2.13.0"
$PIP install "kvpress==0.5.5" "transformers==5.2.*"
"$VENV/bin/python" -c 'import kvpress, transformers, torch; print("kvpress", kvpress.__version__ if hasattr(kvpress, "__version__") else "0.5.5", "transformers", transformers.__version__, "torch", torch.__version__)'
