#!/usr/bin/env bash
# The checks a lent CUDA machine runs (docs/results/performance.md, section 0b): the CUDA tests, then the decode
# and generate benchmarks in bfloat16 with SmolLM2-135M's architecture and random weights (a step's time depends on
# the shapes, not on the weights, and the GGUF weights do not travel).
#
#   OUT=runs/gpu bash scripts/gpu_check.sh [decode methods]
#
# A machine without the network gets the missing packages as wheels in .whl/ (pip download, see the device notes),
# and the model's config.json in .gpu/smollm2-135m/ (save it with
# python -c "from kvcompress.models import load_model; load_model('smollm2-135m')[0].config.save_pretrained('.gpu/smollm2-135m')").
set -o pipefail
OUT=${OUT:-runs/gpu}
METHODS=${1:-window,streaming,h2o,tova,scissorhands,random,knorm,buzz}
source "$(dirname "$0")/gpu_env.sh"
python3 -m pytest tests/gpu -q -rxXf -p no:cacheprovider 2>&1 | tee "$OUT/tests.txt"
bench() {
    date +"%T bench $*"
    python3 -m kvcompress.bench.speed --model .gpu/smollm2-135m --random-weights --device cuda --dtype bfloat16 "$@"
}
bench --sections decode,full --methods "$METHODS" --steps 16 --out "$OUT/decode"
# the cascade at 2K only: its exact prefill runs token by token, thousands of small kernels per token on a GPU (an
# 8K prompt took most of a 7-minute run on an H100)
bench --sections decode --methods cascade --prompts 2048 --steps 16 --out "$OUT/cascade"
bench --sections generate --rounds 2 --out "$OUT/generate"
# the same decoding steps replayed as CUDA graphs (kvcompress.decode_graph), beside their eager rows
python3 -m kvcompress.bench.graph_decode --model .gpu/smollm2-135m --random-weights --device cuda --dtype bfloat16 \
    --steps 16 --out "$OUT/graph"
