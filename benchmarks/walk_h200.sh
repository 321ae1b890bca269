#!/usr/bin/env bash
# The TMA walk (rlk_ops/kernels/triton/walk_decode.py) on the H200, after the FA4 install
# (.gpu/fa4a, .gpu/fa4b; /opt/rlk/env.sh sourced): the small cases of benchmarks/diag_walk_decode.py,
# its CUDA tests, then the probe (benchmarks/probe_walk_decode.py) against the routed pairs + merge
# and FA4 single pass.
# Usage (GPU machine): [VARIANTS=4,8,ws,rows] [TESTS_K=rows] bash benchmarks/walk_h200.sh COMMIT
#   -> $OUT/walk_tests.txt, walk_probe.json  (VARIANTS: the diagnosis's; TESTS_K: a pytest -k filter)
set -u -o pipefail
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
echo "commit ${1:-unknown}" > "$OUT/walk_tests.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$OUT/walk_tests.txt"
# small cases first (benchmarks/diag_walk_decode.py): where the states differ; a hang stops the call here
timeout "${DIAG_LIMIT:-120}" python3 benchmarks/diag_walk_decode.py >> "$OUT/walk_tests.txt" 2>&1
rc=$?; echo "diag rc=$rc" >> "$OUT/walk_tests.txt"
if [ $rc = 124 ]; then tail -30 "$OUT/walk_tests.txt"; echo "the walk hung: no tests, no probe"; exit 1; fi
timeout "${TEST_LIMIT:-240}" python3 -m pytest -m cuda -q -rfE -p no:cacheprovider tests/test_walk_decode.py \
  ${TESTS_K:+-k "$TESTS_K"} > "$OUT/walk_tests.log" 2>&1
echo "pytest rc=$?" >> "$OUT/walk_tests.txt"
tail -60 "$OUT/walk_tests.log" >> "$OUT/walk_tests.txt"; rm -f "$OUT/walk_tests.log"
grep -E "^(diag|pytest) rc|: lens|raised" "$OUT/walk_tests.txt"; tail -4 "$OUT/walk_tests.txt"
timeout "${PROBE_LIMIT:-300}" python3 benchmarks/probe_walk_decode.py "$OUT/walk_probe.json" 2>&1 | tail -8
echo "probe rc=$?"
