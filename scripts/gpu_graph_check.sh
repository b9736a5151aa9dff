#!/usr/bin/env bash
# The CUDA-graph checks on a lent CUDA machine (docs/results/performance.md, section 0b): DecodeGraph's replayed
# step against eager decoding (tests/gpu/test_cuda_graph.py), then the graph_decode benchmark in bfloat16 with
# SmolLM2-135M's architecture and random weights. Packages and the model's config travel as in gpu_check.sh.
#
#   OUT=runs/gpu bash scripts/gpu_graph_check.sh [methods] [prompts]
set -o pipefail
OUT=${OUT:-runs/gpu}
METHODS=${1:-streaming,window,h2o,tova,knorm,random,scissorhands}
PROMPTS=${2:-2048,8192}
source "$(dirname "$0")/gpu_env.sh"
python3 -m pytest tests/gpu/test_cuda_graph.py -q -rxXf -p no:cacheprovider 2>&1 | tee "$OUT/graph-tests.txt"
date +%T
python3 -m kvcompress.bench.graph_decode --model .gpu/smollm2-135m --random-weights --device cuda --dtype bfloat16 \
    --methods "$METHODS" --prompts "$PROMPTS" --steps 16 --out "$OUT/graph"
date +%T
