#!/usr/bin/env bash
# The H200 session for canonical:C (issue 8), after the FA4 + FlashInfer install, in three parts
# (one device command each, at most 10 min):
#   part 1: tests/test_canonical_cuda.py; benchmarks/canonical.py's bitwise sections and decode
#           profile at page 16 -> canonical_bitwise.json/md;
#   part 2: benchmarks/canonical.py's decode (FlashInfer auto measured in the same run when
#           flashinfer is installed; every implementation of a case timed interleaved),
#           training and accuracy sections at page 16 -> canonical_speed.json/md; decode profile
#           and decode at page 128 (FA4's TMA path: page size = its 128-key tile); sessions 12-13
#           also timed the early merge (--early-merge, removed after session 13's run), sessions
#           14-15 the whole-sequence walk (--walk, removed after session 16: slower in 3 runs); then
#           benchmarks/probe_decode_roofline.py (batch 64 against the read roofline, pages 16 and 128;
#           sessions 14-16 also the walk with its merge in one launch, op_walk*)
#           (one part until session 7: the interleaved decode timing made it overrun 10 min)
#   part 3: the CUDA demo single pass and under bare 'canonical' (= 768 since session 12), the
#           whole CUDA test suite except tests/test_canonical_cuda.py, benchmarks/attention.py
#           (strict FA4);
#   part probe: the decode-pair kernel's and the merge's options (tests selected by PROBE_K,
#           then benchmarks/probe_pair_decode_variants.py with VARIANTS) before routing one;
#   part train (session 17): the training merge's tests, its blockings
#           (benchmarks/probe_train_merge.py) and the training kernels' profile
#           (benchmarks/profile_training.py) at C = CHUNKS (default 768).
# ONLY=name,name (session 15): run only those steps of the part, so a part can go over several
# shorter device calls (a machine taken back mid-call returns nothing of that call).
# C values (session 11 on): BITWISE_CHUNKS (part 1, default 256,640,768,1024,2048) and CHUNKS
# (part 2, default 512,640,768,1024), comma-separated multiples of 128.
# Usage (GPU machine, env sourced): bash benchmarks/canonical_h200.sh COMMIT 1|2|3|probe|train
# COMMIT: write the local hash into the device command; the device's git metadata can be stale
# (session 11), and every report also records source_digest (benchmarks/_report.py).
# Writes into $OUT: steps.txt canonical_tests.txt canonical_bitwise.json/md (part 1);
# canonical_speed.json/md canonical_p128.json/md roofline.json (part 2); demo_cuda.json
# demo_cuda_canonical_default.json cuda_tests.txt attention.json attention.md (part 3);
# probe_tests.txt variants.json (probe); train_merge_tests.txt train_merge.json train_profile.json (train)
set -u -o pipefail
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
COMMIT=${1:-unknown}
PART=${2:-1}
BUDGET=${BUDGET:-570}   # seconds of wall time for everything below
T0=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
step() {  # step NAME LIMIT COMMAND...: run with a time limit, record rc and seconds
  local name=$1 limit=$2; shift 2
  if [ -n "${ONLY:-}" ] && [[ ",$ONLY," != *",$name,"* ]]; then return; fi
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
# FA4 must import before any step runs (session 13 lost a call to a fresh machine without it,
# and one to a PYTHONPATH that dropped /opt/rlk/env.sh's entries): stop at once, clearly
if ! python3 -c "import flash_attn.cute" 2>/dev/null; then
  echo "FA4 (flash_attn.cute) does not import: install .gpu/fa4a and .gpu/fa4b on this machine and source" \
       "/opt/rlk/env.sh (PYTHONPATH=$PYTHONPATH)" | tee -a "$OUT/steps.txt"
  exit 3
fi
# pytest-xdist (its and execnet's wheels put into .gpu/fi by benchmarks/gpu_extras.sh, installed with it): the suites' Triton and
# FA4 compiles spread over WORKERS processes on the one GPU (serially, part 3's suite did not finish
# in 360 s in sessions 12-13, and part 1's tests/test_canonical_cuda.py ran out of 150 s in session
# 14; under 8 workers: 244 s and 45 s)
XDIST=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${WORKERS:-8}")
echo "pytest: ${XDIST:-serial (pytest-xdist not installed)}" | tee -a "$OUT/steps.txt"
if [ "$PART" = 1 ]; then
  step canonical_tests 150 "python3 -m pytest -m cuda -q -rfE -p no:cacheprovider $XDIST tests/test_canonical_cuda.py > $OUT/canonical_tests.log 2>&1; rc=\$?; tail -40 $OUT/canonical_tests.log > $OUT/canonical_tests.txt; rm $OUT/canonical_tests.log; tail -3 $OUT/canonical_tests.txt; exit \$rc"
  step canonical_bitwise 380 "python3 benchmarks/canonical.py --sections environment,merge,fa4_equalities,in_place,bitwise,decode_profile --bitwise-chunks ${BITWISE_CHUNKS:-256,640,768,1024,2048} --out $OUT/canonical_bitwise.json --md $OUT/canonical_bitwise.md --commit $COMMIT > $OUT/canonical_bench.log 2>&1; rc=\$?; tail -8 $OUT/canonical_bench.log; exit \$rc"
elif [ "$PART" = 2 ]; then
  step canonical_speed 300 "python3 benchmarks/canonical.py --sections environment,decode,training,accuracy,seqused_zero_probe --chunks ${CHUNKS:-512,640,768,1024} --out $OUT/canonical_speed.json --md $OUT/canonical_speed.md --commit $COMMIT > $OUT/canonical_speed.log 2>&1; rc=\$?; tail -20 $OUT/canonical_speed.log; exit \$rc"
  step canonical_p128 240 "python3 benchmarks/canonical.py --sections environment,decode_profile,decode --decode-page 128 --chunks ${CHUNKS:-512,640,768,1024} --out $OUT/canonical_p128.json --md $OUT/canonical_p128.md --commit $COMMIT > $OUT/canonical_p128.log 2>&1; rc=\$?; tail -12 $OUT/canonical_p128.log; exit \$rc"
  step roofline 160 "python3 benchmarks/probe_decode_roofline.py $OUT/roofline.json 2>&1 | grep -v Warning | tail -6"
elif [ "$PART" = probe ]; then
  step probe_tests 200 "python3 -m pytest -m cuda -q -rfE -p no:cacheprovider $XDIST tests/test_triton_pair_decode.py tests/test_canonical_cuda.py -k '${PROBE_K:-ahead or l2_prefetch or merge_config or decode_pairs}' > $OUT/probe_tests.log 2>&1; rc=\$?; tail -30 $OUT/probe_tests.log > $OUT/probe_tests.txt; rm $OUT/probe_tests.log; tail -3 $OUT/probe_tests.txt; exit \$rc"
  step probe_variants 360 "python3 benchmarks/probe_pair_decode_variants.py $OUT/variants.json 2>&1 | tail -40"
elif [ "$PART" = 3 ]; then
  step demo_single_pass 80 "python3 -m rlk_ops demo --device cuda --quiet --json $OUT/demo_cuda.json | tail -4"
  step demo_canonical 120 "python3 -m rlk_ops demo --device cuda --quiet --split-kv canonical --json $OUT/demo_cuda_canonical_default.json | tail -4"
  step cuda_suite 360 "python3 -m pytest -m cuda -q -rfEs -p no:cacheprovider $XDIST --durations=12 tests/ --ignore=tests/test_canonical_cuda.py > $OUT/cuda_suite_full.log 2>&1; rc=\$?; tail -5 $OUT/cuda_suite_full.log; exit \$rc"
  tail -60 "$OUT/cuda_suite_full.log" > "$OUT/cuda_tests.txt" 2>/dev/null; rm -f "$OUT/cuda_suite_full.log"
  step attention_benchmark 100 "python3 benchmarks/attention.py --out $OUT/attention.json --md $OUT/attention.md 2>&1 | tail -8"
elif [ "$PART" = train ]; then
  step train_merge_tests 120 "python3 -m pytest -m cuda -q -rfE -p no:cacheprovider $XDIST tests/test_canonical_cuda.py -k 'skipping or merge_config or routed_training' > $OUT/train_merge_tests.log 2>&1; rc=\$?; tail -20 $OUT/train_merge_tests.log > $OUT/train_merge_tests.txt; rm $OUT/train_merge_tests.log; tail -3 $OUT/train_merge_tests.txt; exit \$rc"
  step train_merge 200 "CHUNKS=${CHUNKS:-768} python3 benchmarks/probe_train_merge.py $OUT/train_merge.json 2>&1 | grep -v Warning | tail -4"
  step train_profile 150 "CHUNKS=${CHUNKS:-768} python3 benchmarks/profile_training.py $OUT/train_profile.json 2>&1 | grep -v Warning | tail -6"
else
  echo "usage: canonical_h200.sh COMMIT 1|2|3|probe|train (got part $PART)"; exit 2
fi
echo "=== steps"; cat "$OUT/steps.txt"
