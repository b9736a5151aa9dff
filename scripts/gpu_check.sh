#!/usr/bin/env bash
# The checks a lent CUDA machine runs (docs/results/performance.md, "On a GPU"), in one call, most needed first,
# each under its own time limit so that one slow part cannot take the rest's time:
#   1. the CUDA tests (tests/gpu: equivalence, device and dtype, no host sync, DecodeGraph's replay per method);
#   2. KVzip's prefill and compression against a full prefill (experiments.kvzip_cost), SmolLM2-135M's and
#      Qwen2.5-Coder-0.5B's shapes, 8K tokens in the default 2K chunks and in one chunk, beside SnapKV's and KeyDiff's;
#   3. DecodeGraph's replayed steps against eager ones (kvcompress.bench.graph_decode), every graphed method;
#   4. the eager decoding step of every decode-time method (kvcompress.bench.speed --sections decode,full).
# Benchmarks run in bfloat16 with random weights (a step's time depends on the shapes, not on the weights, and the
# GGUF weights do not travel).
#
#   OUT=runs/gpu bash scripts/gpu_check.sh            # ~8 minutes on an H200 at most (the limits below)
#
# A machine without the network gets the missing packages as wheels in .whl/ (pip download, see the device notes;
# transformers 5.24.0 takes the huggingface_hub such a machine has), and each model's config and tokenizer in
# .gpu/NAME/ (save them with
# python -c "from kvcompress.models import load_model; m, t = load_model('NAME'); m.config.save_pretrained('.gpu/NAME'); t.save_pretrained('.gpu/NAME')"
# for NAME smollm2-135m and qwen2.5-coder-0.5b). Both folders are ignored by git: the device call carries them.
set -o pipefail
OUT=${OUT:-runs/gpu}
source "$(dirname "$0")/gpu_env.sh"
SMOL=.gpu/smollm2-135m
QWEN=.gpu/qwen2.5-coder-0.5b
LOAD=(--random-weights --device cuda --dtype bfloat16)
part() {  # part SECONDS NAME COMMAND...: one part, stopped at its limit
    local limit=$1 name=$2
    shift 2
    date +"%T $name (at most ${limit}s)"
    timeout "$limit" "$@" || echo "$name: exit $? (124: stopped at its ${limit}s limit)"
}
part 150 tests python3 -m pytest tests/gpu -q -rxXf -p no:cacheprovider
for model in $SMOL $QWEN; do
    part 75 "kvzip cost $model" python3 -m experiments.kvzip_cost --model $model "${LOAD[@]}" --tokens 8192 --reps 3 \
        --methods kvzip:ratio=0.5 kvzip:ratio=0.5,chunk_size=8192 snapkv:ratio=0.5 keydiff:ratio=0.5
done
part 120 graph python3 -m kvcompress.bench.graph_decode --model $SMOL "${LOAD[@]}" \
    --methods window,h2o,tova,knorm,random,scissorhands,less,streaming --prompts 2048 --steps 12 \
    --generate-prompts 1024 --rounds 1 --out "$OUT/graph"
# the cascade at 2K only: its exact prefill runs token by token, thousands of small kernels per token on a GPU
part 120 decode python3 -m kvcompress.bench.speed --model $SMOL "${LOAD[@]}" --sections decode,full --prompts 2048 \
    --steps 12 --out "$OUT/decode"
date +"%T done"
