#!/usr/bin/env bash
# The main job: set up .venv, then show what kvcompress is for, on the default model (SmolLM2-135M-Instruct), CPU.
# Nothing outside the repository is read: the text comes from the books shipped with the package.
#  1. One question, three caches (examples/needle.py): a number hidden in ~1,200 tokens of a book, asked for after
#     the text; the full cache, one-shot TOVA keeping 30 % of the prompt (chosen with the question) and StreamingLLM
#     keeping 256 tokens answer it (the answer, tokens stored, MiB).
#  2. The leaderboard: RULER's needle tasks that this model answers with the full cache (niah_single_1,
#     niah_single_2, niah_multikey_1, niah_multivalue) at 1,024 tokens, the context compressed before the question
#     (kvpress's protocol), KVzip, SnapKV, StreamingLLM and random eviction (the floor) at kept ratios 0.75, 0.5 and
#     0.25 of the context beside the full cache: one table (score ± standard error, n, KV bytes × full, prefill +
#     compression seconds, answer tokens/s) and one plot; a line per evaluation while it runs.
#  Cost, measured (docs/results/ruler.md): parts 2 and 3 take about 8 minutes of CPU time with one torch thread.
#  3. The same leaderboard for qwen2.5-coder-0.5b when its wheels are installed (`kvcompress models`).
# DEMO_SAMPLES (default 4: one per task) and DEMO_METHODS change part 2. Results are resumable JSON lines under
# runs/demo/ (a rerun only adds what is missing).
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== [1/4] setting up .venv (scripts/setup.sh; the first run installs torch and the default model) =="
KVCOMPRESS_EXTRAS="${KVCOMPRESS_EXTRAS:-eval}" bash scripts/setup.sh  # the demo needs no test or lm-eval packages
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
THREADS="$OMP_NUM_THREADS"
SAMPLES="${DEMO_SAMPLES:-4}"
METHODS="${DEMO_METHODS:-full,kvzip,snapkv,streaming,random}"
TASKS="niah_single_1+niah_single_2+niah_multikey_1+niah_multivalue"

echo "== [2/4] one question, three caches (smollm2-135m) =="
.venv/bin/python examples/needle.py

leaderboard() {  # MODEL SAMPLES
  echo "== leaderboard on $1: $2 samples x ($(echo "$METHODS" | tr ',' '\n' | grep -vc '^full$') methods x 3 kept ratios + full) =="
  .venv/bin/kvcompress leaderboard --model "$1" --methods "$METHODS" --kept 0.75,0.5,0.25 --samples "$2" \
    --threads "$THREADS" --param length=1024 --param tasks="$TASKS" --out runs/demo
}

echo "== [3/4] the leaderboard on smollm2-135m =="
leaderboard smollm2-135m "$SAMPLES"
echo "== [4/4] the leaderboard on qwen2.5-coder-0.5b =="
if .venv/bin/python -c "import sys, kvcompress.models as m; sys.exit(not any(
    i.name == 'qwen2.5-coder-0.5b' and i.installed for i in m.list_models()))"; then
  leaderboard qwen2.5-coder-0.5b "${DEMO_QWEN_SAMPLES:-4}"
else
  echo "qwen2.5-coder-0.5b is not installed: its leaderboard is skipped (\`kvcompress models\` says how)."
fi
