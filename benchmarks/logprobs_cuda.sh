#!/usr/bin/env bash
# The CUDA log-probs (kernels/triton/logprobs.py) on the GPU machine, with nothing installed (Triton and torch
# are there; FA4 is not needed):   run: bash benchmarks/logprobs_cuda.sh COMMIT
#   1. the CUDA lanes of tests/test_triton_logprobs.py and tests/test_token_logprobs.py -> $OUT/tests_logprobs_cuda.log
#   2. token_logprobs, the engine's log_softmax and the embedding op against torch's (benchmarks/logprobs_cost.py)
#      -> $OUT/logprobs_cost_cuda.{txt,json}
# (benchmarks/rl_loop_cuda.sh runs both again after the FA4 install, with the demo and the model-level lanes.)
set -u -o pipefail
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
{ echo "commit ${1:-unknown}"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader;
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
  > "$OUT/machine.txt" 2>&1
timeout 300 python3 -m pytest -q -rA -p no:cacheprovider -m cuda tests/test_triton_logprobs.py tests/test_token_logprobs.py \
  > "$OUT/tests_logprobs_cuda.log" 2>&1; echo "tests rc=$?"; tail -3 "$OUT/tests_logprobs_cuda.log"
timeout 200 python3 -m benchmarks.logprobs_cost --device cuda --out "$OUT/logprobs_cost_cuda.json" \
  > "$OUT/logprobs_cost_cuda.txt" 2>&1; echo "logprobs cost rc=$?"; tail -8 "$OUT/logprobs_cost_cuda.txt"
