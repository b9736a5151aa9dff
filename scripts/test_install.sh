#!/usr/bin/env bash
# Install kvcompress as a wheel (not editable) into a fresh virtual environment and run the CLI from a folder outside
# the repository: `generate` (default method), `generate` with the LESS kernels shipped in the wheel, `eval ruler` on
# the books shipped in the wheel, `eval --data` and `report`. Each command must exit 0 and print what it promises.
#
# Environment: PYTHON (default python3) makes the venv; KVCOMPRESS_DATA (default ../shared/data, as the tests use)
# is the data folder, passed to `eval` with --data only; KVCOMPRESS_CACHE (default ~/.cache/kvcompress/models) holds
# converted models: the default model is converted there on first use and reused afterwards. Everything else lives
# in a temporary folder that is removed at the end.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
DATA="${KVCOMPRESS_DATA:-$REPO/../shared/data}"
[ -d "$DATA" ] && DATA="$(cd "$DATA" && pwd)"
unset KVCOMPRESS_DATA
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
VENV="$WORK/venv"
START=$SECONDS

step() { echo "== [$((SECONDS - START)) s] $*"; }
# pip without the machine config's warnings about local index folders that lack a package.
pip_quiet() {
  "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@" 2>&1 | { grep -v "it is neither a file nor a directory" || true; }
}
# run_check PATTERN CMD...: run CMD in $WORK/run, show its output, fail unless it exits 0 and prints PATTERN.
run_check() {
  local pattern="$1"
  shift
  local status=0
  (cd "$WORK/run" && "$@") >"$WORK/out.txt" 2>&1 || status=$?
  cat "$WORK/out.txt"
  if [ "$status" -ne 0 ]; then
    echo "FAILED (exit $status): $*" >&2
    exit 1
  fi
  if ! grep -Eq -- "$pattern" "$WORK/out.txt"; then
    echo "FAILED (no line matching '$pattern'): $*" >&2
    exit 1
  fi
}

step "fresh venv and wheel"
"$PYTHON" -m venv "$VENV"
pip_quiet wheel --no-deps -w "$WORK/dist" "$REPO"
WHEEL="$(ls "$WORK"/dist/kvcompress-*.whl)"
# The CPU build of torch first: a bare `torch` requirement would pull a multi-GB CUDA build. --no-compile: byte-
# compiling every module of torch at install time costs more than compiling the few that the commands import.
step "install torch, then $(basename "$WHEEL")[eval]"
pip_quiet install --no-compile "torch==2.13.0"
pip_quiet install --no-compile "$WHEEL[eval]"
KVC="$VENV/bin/kvcompress"
mkdir "$WORK/run"
run_check . "$VENV/bin/python" -c \
  "import kvcompress, pathlib; p = pathlib.Path(kvcompress.__file__); assert 'site-packages' in p.parts, p; print(p)"

step "install the default model with the command that \`kvcompress models\` prints"
run_check "smollm2-135m: pip install" "$KVC" models
INSTALL="$(sed -n 's/^ *smollm2-135m: //p' "$WORK/out.txt")"
# shellcheck disable=SC2086  # the printed command is split into words on purpose
pip_quiet ${INSTALL#pip }

step "generate (default method)"
run_check "tokens stored per layer" "$KVC" generate "Hello" --max-new-tokens 8
step "generate with the shipped LESS kernels"
# A prompt longer than the budget (about 80 tokens with the chat template), so that H2O evicts and LESS keeps 50.
PROMPT="Tell me about the sea, the sky and the hills: what lives in each, how they change with the seasons, and why"
PROMPT="$PROMPT painters and poets keep coming back to them, from the old masters to the present day."
run_check "tokens stored per layer \(physical\) +│ 50 " "$KVC" generate "$PROMPT" --max-new-tokens 8 \
  --method less --budget 50 -p base=h2o -p kernels=smollm2-135m-h2o-50of512
step "eval ruler on the books shipped in the wheel (no data folder)"
run_check . "$KVC" eval ruler --samples 1 --methods full --param length=512 --param tasks=niah_single_2 \
  --out "$WORK/run/ruler"
grep -q '"method": "full"' "$WORK/run/ruler/ruler.jsonl" || { echo "FAILED: eval ruler wrote no result row" >&2; exit 1; }
if [ -d "$DATA" ]; then
  step "eval ppl --data $DATA"
  run_check . "$KVC" eval ppl --samples 1 --methods full,streaming --budgets 64 --param length=256 \
    --data "$DATA" --out "$WORK/run/results"
  test -s "$WORK/run/results/ppl.jsonl" || { echo "FAILED: eval wrote no results/ppl.jsonl" >&2; exit 1; }
  step "report"
  run_check . "$KVC" report results --out report
  grep -Eq "^\| streaming \| +\| [0-9.]+ \(1\) \|" "$WORK/run/report.md" \
    || { cat "$WORK/run/report.md"; echo "FAILED: report.md has no streaming row with a value" >&2; exit 1; }
  ls "$WORK"/run/report-*.png >/dev/null || { echo "FAILED: report drew no plot" >&2; exit 1; }
else
  step "eval and report skipped: no data folder at $DATA (set KVCOMPRESS_DATA)"
fi
step "wheel install OK"
