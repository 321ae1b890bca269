#!/usr/bin/env bash
# The H200 session for canonical:C (issue 8), in one command after the FA4 install:
#   tests/test_canonical_cuda.py, benchmarks/canonical.py, the CUDA demo (single pass, then
#   canonical:1024 and canonical:128), then the whole CUDA test suite with what time is left.
# Usage (GPU machine, FA4 installed, env sourced): bash benchmarks/canonical_h200.sh COMMIT
# Writes into $OUT (at most 8 files): log.txt steps.txt canonical_tests.txt canonical.json
# canonical.md demo_cuda.json demo_cuda_canonical.json cuda_tests.txt
set -u -o pipefail
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
COMMIT=${1:-unknown}
BUDGET=${BUDGET:-500}   # seconds of wall time for everything below
T0=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
step() {  # step NAME LIMIT COMMAND...: run with a time limit, record rc and seconds
  local name=$1 limit=$2; shift 2
  local l; l=$(left)
  (( limit > l )) && limit=$l
  if (( limit < 20 )); then echo "$name skipped (no time left)" | tee -a "$OUT/steps.txt"; return; fi
  echo "=== $name (limit ${limit}s)"
  local t=$(date +%s)
  timeout "$limit" bash -c "set -o pipefail; $*"
  local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - t ))s" | tee -a "$OUT/steps.txt"
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/steps.txt"
step canonical_tests 130 "python3 -m pytest -m cuda -q -rfE -p no:cacheprovider tests/test_canonical_cuda.py 2>&1 | tee $OUT/canonical_tests.txt | tail -25"
step benchmark 200 "python3 benchmarks/canonical.py --out $OUT/canonical.json --md $OUT/canonical.md --commit $COMMIT"
step demo_single_pass 90 "python3 -m rlk_ops demo --device cuda --quiet --json $OUT/demo_cuda.json"
step demo_canonical_1024 70 "python3 -m rlk_ops demo --device cuda --quiet --split-kv canonical:1024 --json $OUT/demo_cuda_canonical.json"
# prompts are 20-200 tokens, so canonical:1024 is one chunk per row; canonical:128 merges up to 2 states
step demo_canonical_128 60 "python3 -m rlk_ops demo --device cuda --quiet --split-kv canonical:128 | tail -12"
# the rest of the CUDA suite (test_canonical_cuda.py ran above: canonical_tests.txt)
step cuda_suite 400 "python3 -m pytest -m cuda -q -rfEs -p no:cacheprovider tests/ --ignore=tests/test_canonical_cuda.py 2>&1 | tee $OUT/cuda_suite_full.log | tail -5"
tail -40 "$OUT/cuda_suite_full.log" > "$OUT/cuda_tests.txt" 2>/dev/null; rm -f "$OUT/cuda_suite_full.log"
echo "=== steps"; cat "$OUT/steps.txt"
