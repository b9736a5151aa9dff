#!/usr/bin/env bash
# Side by side with kvpress (docs/vs-kvpress.md): build the kvpress environment, write the samples, run both
# sides, write the tables. Every step resumes: rerunning skips the rows already written.
#
#   bash scripts/vs_kvpress.sh                 # 8 niah single-needle samples, ~1K tokens, budgets 128,512
#   SAMPLES=10 BUDGETS=128,256 bash scripts/vs_kvpress.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-runs/vs-kvpress}"
SAMPLES="${SAMPLES:-8}"
LENGTH="${LENGTH:-1024}"
BUDGETS="${BUDGETS:-128,512}"
EXTRA_SAMPLES="${EXTRA_SAMPLES:-4}"  # samples for the extra one-shot variants
KVPRESS_VENV="${KVPRESS_VENV:-/work/kvpress-venv}"
PY="${KVCOMPRESS_PYTHON:-python}"   # the kvcompress environment's python
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error
KVPRESS_VENV="$KVPRESS_VENV" bash scripts/vs_kvpress_env.sh
"$PY" -m experiments.compare samples --out "$OUT" --samples "$SAMPLES" --length "$LENGTH" --budgets "$BUDGETS"
"$KVPRESS_VENV/bin/python" scripts/vs_kvpress_side.py "$OUT/samples.json" "$OUT/kvpress.jsonl"
# Our methods named in the issue on every sample; the exact one-shot counterparts on the first EXTRA_SAMPLES.
"$PY" -m experiments.compare ours --out "$OUT" \
  --methods "full,streaming,snapkv:window=64;kernel=5;pooling=avg,tova,knorm,h2o_oneshot"
"$PY" -m experiments.compare ours --out "$OUT" --samples "$EXTRA_SAMPLES" \
  --methods "streaming_oneshot:position_mode=original,tova_oneshot,h2o_oneshot:heavy_ratio=1.0"
# preset="kvpress": the shared methods with kvpress's settings in one argument (issue 20)
"$PY" -m experiments.compare ours --out "$OUT" \
  --methods "streaming_oneshot:preset=kvpress,snapkv:preset=kvpress,tova_oneshot:preset=kvpress,knorm:preset=kvpress"
"$PY" -m experiments.compare report --out "$OUT" --doc-data docs/results/vs-kvpress-data
