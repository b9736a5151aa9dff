#!/usr/bin/env bash
# Set up .venv, then the main job (CPU, 1 torch thread; under 10 minutes on 2 cores with the default model):
#  1. generate from a ~4,000-token prompt with a 256-token StreamingLLM cache, then with LESS over H2O (shipped
#     kernels), and show tokens seen vs stored and the memory saved;
#  2. passkey retrieval with the question at the end of a 512-token prompt, on SmolLM2-135M: the full cache vs
#     query-agnostic methods that evict while reading (window, streaming, h2o) and query-aware ones that compress
#     once after the question (snapkv, nacl), at budgets 64 and 128. One table (accuracy and the key's answer NLL,
#     teacher-forced through the compressed cache, lower is better, each ± standard error over DEMO_SAMPLES
#     samples; stored KV MiB and seconds per sample beside the full cache's) and one plot, whose path is printed.
#     The prompt is prefilled 32 tokens per forward: a chunk as large as the budget leaves an evicting method no
#     choice (the chunk's own tokens fill the budget), so H2O at budget 64 with 64-token chunks is exactly window;
#  3. the same for qwen2.5-coder-0.5b when its wheels are installed (`kvcompress models`), else a one-line notice;
#     DEMO_QWEN_SAMPLES samples (default 3: the 0.5B model has 3.7x the parameters of SmolLM2-135M, so this
#     part adds minutes; not timed here).
# Results are resumable JSONL under runs/demo/MODEL/ (a rerun only adds what is missing).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1
export KVCOMPRESS_DATA="${KVCOMPRESS_DATA:-$(pwd)/../shared/data}"
DATA="$KVCOMPRESS_DATA"
SAMPLES="${DEMO_SAMPLES:-6}"
PROMPT="$(mktemp)"
{ head -c 15000 "$DATA/paul_graham_essays/founders.txt"; printf '\n\nWhat is the main advice of the essay above? Answer in two sentences.\n'; } > "$PROMPT"
.venv/bin/kvcompress generate --file "$PROMPT" --method streaming --budget 256 --max-new-tokens 48
# LESS over H2O with the kernels shipped for this model (no training step needed)
.venv/bin/kvcompress generate --file "$PROMPT" --method less --budget 256 -p base=h2o \
  -p kernels=smollm2-135m-h2o-50of512 --max-new-tokens 48
rm -f "$PROMPT"

passkey() {  # MODEL SAMPLES: evaluate, then print the summary table and the plot's path
  local out="runs/demo/$1"
  echo "== passkey on $1: $2 samples x 11 configurations =="
  .venv/bin/kvcompress eval passkey --model "$1" --methods full,window,streaming,h2o,snapkv,nacl \
    --budgets 64,128 --samples "$2" --out "$out" --param length=512 --param chunk_size=32
  .venv/bin/kvcompress report "$out" --out "$out/report" --summary
}

passkey smollm2-135m "$SAMPLES"
if .venv/bin/python -c "import sys, kvcompress.models as m; sys.exit(not any(
    i.name == 'qwen2.5-coder-0.5b' and i.installed for i in m.list_models()))"; then
  passkey qwen2.5-coder-0.5b "${DEMO_QWEN_SAMPLES:-3}"
else
  echo "qwen2.5-coder-0.5b is not installed: its passkey table is skipped (\`kvcompress models\` says how)."
fi
