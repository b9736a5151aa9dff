#!/usr/bin/env bash
# Set up .venv and run the main job on the default model: generate from a ~4,000-token prompt with a
# 256-token StreamingLLM cache and show the memory saved.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
DATA="${KVCOMPRESS_DATA:-../shared/data}"
PROMPT="$(mktemp)"
{ head -c 15000 "$DATA/paul_graham_essays/founders.txt"; printf '\n\nWhat is the main advice of the essay above? Answer in two sentences.\n'; } > "$PROMPT"
.venv/bin/kvcompress generate --file "$PROMPT" --method streaming --budget 256 --max-new-tokens 64
rm -f "$PROMPT"
