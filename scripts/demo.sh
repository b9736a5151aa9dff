#!/usr/bin/env bash
# Set up .venv, then the main job on the default model (SmolLM2-135M, CPU, 1 thread), a few minutes:
#  1. generate from a ~4,000-token prompt with a 256-token StreamingLLM cache, then with LESS over H2O (shipped
#     kernels), and show the memory saved;
#  2. a small passkey evaluation (full vs window vs streaming vs h2o at 128 tokens), printed as a table and
#     plotted to runs/demo/report-*.png.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1
export KVCOMPRESS_DATA="${KVCOMPRESS_DATA:-$(pwd)/../shared/data}"
DATA="$KVCOMPRESS_DATA"
SAMPLES="${DEMO_SAMPLES:-4}"
PROMPT="$(mktemp)"
{ head -c 15000 "$DATA/paul_graham_essays/founders.txt"; printf '\n\nWhat is the main advice of the essay above? Answer in two sentences.\n'; } > "$PROMPT"
.venv/bin/kvcompress generate --file "$PROMPT" --method streaming --budget 256 --max-new-tokens 48
# LESS over H2O with the kernels shipped for this model (no training step needed)
.venv/bin/kvcompress generate --file "$PROMPT" --method less --budget 256 -p base=h2o \
  -p kernels=smollm2-135m-h2o-50of512 --max-new-tokens 48
rm -f "$PROMPT"
.venv/bin/kvcompress eval passkey --methods full,window,streaming,h2o --budgets 128 --samples "$SAMPLES" \
  --out runs/demo --param length=512 --param chunk_size=64
.venv/bin/kvcompress report runs/demo --out runs/demo/report
cat runs/demo/report.md
