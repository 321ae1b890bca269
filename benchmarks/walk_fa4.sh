#!/usr/bin/env bash
# The FA4 chunk walk (rlk_ops/kernels/fa4/walk.py) on the GPU machine, after the FA4 install
# (.gpu/fa4a, .gpu/fa4b; the pytest-xdist wheels in .gpu/xd): its CUDA tests, then the probe
# (benchmarks/probe_fa4_walk.py), then the Triton pair/walk CUDA tests (pair kernel at other G).
# Usage (GPU machine): [PAIRS=none|all|K] [TESTS_K=...] bash benchmarks/walk_fa4.sh COMMIT [PROBE_CASES]
#   COMMIT: the local tree's commit, typed out (the device's git metadata is stale).
#   PROBE_CASES: BxCTX,... (default 64x8192,64x32768), or none to run the tests only.
#   -> $OUT/walk_fa4_tests.log, $OUT/walk_fa4_probe.json, $OUT/pair_walk_tests.log
set -u -o pipefail
source /opt/rlk/env.sh
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /opt/rlk/site .gpu/xd/*.whl 2>/dev/null
{ echo "commit ${1:-unknown}"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader;
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$OUT/machine_walk.txt"
timeout 300 python3 -m pytest -m cuda -q -rfE -p no:cacheprovider tests/test_fa4_walk.py tests/test_canonical_cuda.py -k "${TESTS_K:-walk or pair_routes}" > "$OUT/walk_fa4_tests.log" 2>&1
echo "walk tests rc=$?"; grep -E "passed|failed|Error|error" "$OUT/walk_fa4_tests.log" | tail -15
if [ "${2:-}" != none ]; then   # PROBE_CASES=none: the tests only
  CASES=${2:-64x8192,64x32768} timeout 250 python3 benchmarks/probe_fa4_walk.py "$OUT/walk_fa4_probe.json" 2>&1 \
    | grep -v Warning | tail -6
  echo "probe rc=$?"
fi
if [ "${PAIRS:-none}" != none ]; then   # PAIRS=all, or a -k filter (e.g. other_group_sizes); default none
  timeout 400 python3 -m pytest -m cuda -q -rfE -n 8 -p no:cacheprovider tests/test_triton_pair_decode.py \
    tests/test_walk_decode.py ${PAIRS:+$( [ "$PAIRS" != all ] && echo "-k $PAIRS")} > "$OUT/pair_walk_tests.log" 2>&1
  echo "pair/walk rc=$?"; tail -3 "$OUT/pair_walk_tests.log"
fi
