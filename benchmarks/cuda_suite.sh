#!/usr/bin/env bash
# The whole CUDA suite on the GPU machine, after the FA4 install (.gpu/fa4a, .gpu/fa4b) and,
# when sent, FlashInfer's wheel in three parts (.gpu/fi1..3: split -b here, so that each call
# stays under the 64 MiB a call may carry with the tree; reassembled and checked by sha256 here).
# Usage (GPU machine): bash benchmarks/cuda_suite.sh COMMIT PART
#   PART=main: FlashInfer install, the CUDA demos (single pass, canonical, compiled rollout), `pytest -m cuda -n 8 tests/` except the two
#              pair/walk files, then the CPU tests named *compile* (19 on CPU here) under the GPU
#              machine's torch -> $OUT/demo_cuda*.json, $OUT/cuda_suite.log, $OUT/compile_cpu_tests.log
#   PART=demos: the same without the pytest run (when little device time is left)
#   PART=pairs: tests/test_triton_pair_decode.py and tests/test_walk_decode.py -> $OUT/pair_walk_tests.log
set -u -o pipefail
source /opt/rlk/env.sh
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /opt/rlk/site .gpu/xd/*.whl 2>/dev/null
{ echo "commit ${1:-unknown}"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader;
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
  > "$OUT/machine_${2:-main}.txt"
if [ "${2:-main}" = main ] || [ "${2:-main}" = demos ]; then
  if [ -d .gpu/fi3 ] && [ ! -d /opt/rlk/site/flashinfer ]; then
    mkdir -p .gpu/fiw && cp .gpu/fi3/install.sh .gpu/fiw/
    cat .gpu/fi1/fipart.* .gpu/fi2/fipart.* .gpu/fi3/fipart.* > .gpu/fiw/flashinfer_python-0.7.2.post1-py3-none-any.whl
    (cd .gpu/fiw && echo "$(cut -d' ' -f1 ../fi3/sha)  flashinfer_python-0.7.2.post1-py3-none-any.whl" \
      | sha256sum -c --quiet) \
      && bash .gpu/fiw/install.sh
  fi
  python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" >> "$OUT/machine_${2:-main}.txt" 2>&1
  timeout 150 python3 -m rlk_ops demo --device cuda --quiet --json "$OUT/demo_cuda.json"; echo "demo rc=$?"
  timeout 150 python3 -m rlk_ops demo --device cuda --split-kv canonical --quiet \
    --json "$OUT/demo_cuda_canonical.json"; echo "demo canonical rc=$?"
  # the rollout under Inductor (compiled_rollout), the trainer eager (session 35; not yet run on a GPU)
  timeout 200 python3 -m rlk_ops demo --device cuda --compile --quiet --json "$OUT/demo_cuda_compile.json"
  echo "demo compile rc=$?"
  [ "${2:-main}" = demos ] && exit 0
  timeout 330 python3 -m pytest -m cuda -q -rfEs -n 8 -p no:cacheprovider tests/ \
    --ignore=tests/test_walk_decode.py --ignore=tests/test_triton_pair_decode.py > "$OUT/cuda_suite.log" 2>&1
  echo "suite rc=$?"; tail -5 "$OUT/cuda_suite.log"
  # the CPU compile tests (fullgraph=True) under this machine's torch: CI runs torch 2.13 only, and
  # Dynamo differs (session 39's autocast check broke the graph on 2.11 alone; session 40)
  timeout 240 python3 -m pytest -m "not cuda" -k compile -q -rfE -n 8 -p no:cacheprovider tests/test_block.py \
    tests/test_compile_ops.py tests/test_canonical.py tests/test_qk_norm_rope.py tests/test_rollout.py \
    tests/test_strict.py tests/test_validation.py tests/test_collectives.py > "$OUT/compile_cpu_tests.log" 2>&1
  echo "cpu compile tests rc=$?"; tail -2 "$OUT/compile_cpu_tests.log"
else
  timeout 560 python3 -m pytest -m cuda -q -rfEs -n 8 -p no:cacheprovider tests/test_triton_pair_decode.py \
    tests/test_walk_decode.py > "$OUT/pair_walk_tests.log" 2>&1
  echo "pair/walk rc=$?"; tail -5 "$OUT/pair_walk_tests.log"
fi
