#!/usr/bin/env bash
# On the GPU machine after the FA4 install (.gpu/fa4a, .gpu/fa4b) and transformers' wheels (.gpu/hf):
#   send .gpu/hf, run: bash .gpu/hf/install.sh > /dev/null && bash benchmarks/rl_loop_cuda.sh COMMIT
#   0. the demo on CUDA (TinyQwen3; its log-probs on the Triton kernel since session 47) -> $OUT/demo_cuda.{txt,json}
#   1. the CUDA lanes of tests/test_hf_model.py (the demo's too), tests/test_hf.py,
#      tests/test_weight_sync.py (the FSDP2 loop on one GPU, eager and compiled), tests/test_token_logprobs.py
#      tests/test_triton_logprobs.py (the CUDA log-probs kernel) and tests/test_embedding_op.py -> $OUT/tests_cuda.log
#   2. examples/fsdp_rl_loop.py on one GPU (NCCL, world 1), eager and --compile -> $OUT/fsdp_rl_loop{,_compile}.{txt,json}
#   3. token_logprobs and the embedding op against torch's on the GPU (benchmarks/logprobs_cost.py)
#      -> $OUT/logprobs_cost_cuda.{txt,json}
#   4. the training-step benchmark's lanes (benchmarks/hf_train_step.py) -> $OUT/hf_train_step.{txt,json}
source "$(dirname "$0")/_hf_gpu_env.sh" "${1:-unknown}"
timeout 120 python3 -m rlk_ops demo --device cuda --json "$OUT/demo_cuda.json" > "$OUT/demo_cuda.txt" 2>&1
echo "demo rc=$?"; grep -E "mismatched|RESULT" "$OUT/demo_cuda.txt" | head -8
tests="tests/test_hf.py tests/test_weight_sync.py tests/test_token_logprobs.py tests/test_triton_logprobs.py tests/test_embedding_op.py"
timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -rA -p no:cacheprovider -m cuda tests/test_hf_model.py $tests \
  > "$OUT/tests_cuda.log" 2>&1; echo "tests rc=$?"; tail -3 "$OUT/tests_cuda.log"
for c in "" "--compile"; do
  tag=fsdp_rl_loop${c:+_compile}
  timeout 150 python3 -m torch.distributed.run --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint localhost:0 \
    examples/fsdp_rl_loop.py $c --json "$OUT/$tag.json" > "$OUT/$tag.txt" 2>&1; echo "$tag rc=$?"
  grep -v Warning "$OUT/$tag.txt" | tail -9
done
timeout 120 python3 -m benchmarks.logprobs_cost --device cuda --out "$OUT/logprobs_cost_cuda.json" \
  > "$OUT/logprobs_cost_cuda.txt" 2>&1; echo "logprobs cost rc=$?"; tail -6 "$OUT/logprobs_cost_cuda.txt"
[ "${SKIP_TRAIN_STEP:-0}" = 1 ] && exit 0
timeout 200 python3 -m benchmarks.hf_train_step --out "$OUT/hf_train_step.json" --steps 5 --warmup 2 \
  > "$OUT/hf_train_step.txt" 2>&1; echo "train step rc=$?"; tail -8 "$OUT/hf_train_step.txt"
