#!/usr/bin/env bash
# The whole-model HF lanes on the GPU machine, after the FA4 install (.gpu/fa4a, .gpu/fa4b) and
# transformers' wheels (.gpu/hf: send .gpu/hf, run `bash .gpu/hf/install.sh && bash THIS COMMIT`).
#   1. tests/test_hf_model.py and tests/test_hf.py, CPU and CUDA lanes -> $OUT/test_hf_cuda.log
#   2. the demo on a random Qwen3-0.6B-shaped checkpoint (benchmarks/make_hf_checkpoint.py): page 16
#      single pass, page 128 canonical -> $OUT/demo_hf_*.json
#   3. a training step, SDPA vs rlk attention vs every stage on rlk (benchmarks/hf_train_step.py)
#      -> $OUT/hf_train_step.json, $OUT/hf_train_step_profile.txt
source "$(dirname "$0")/_hf_gpu_env.sh" "${1:-unknown}"
timeout 240 python3 -m pytest -q -rA -p no:cacheprovider tests/test_hf_model.py tests/test_hf.py \
  > "$OUT/test_hf_cuda.log" 2>&1; echo "tests rc=$?"; tail -3 "$OUT/test_hf_cuda.log"
python3 -m benchmarks.make_hf_checkpoint /tmp/qwen3-0.6b --shape qwen3-0.6b
for lane in "p16 --page-size 16" "p128_canonical --page-size 128 --split-kv canonical"; do
  set -- $lane
  name=$1; shift
  timeout 150 python3 -m rlk_ops demo --device cuda --hf-model /tmp/qwen3-0.6b --quiet "$@" \
    --json "$OUT/demo_hf_$name.json" > "$OUT/demo_hf_$name.txt" 2>&1; echo "demo $name rc=$?"
  grep -E "rollout vs|forward vs|negative|RESULT" "$OUT/demo_hf_$name.txt"
done
timeout 300 python3 -m benchmarks.hf_train_step --out "$OUT/hf_train_step.json" --steps 5 --warmup 2 \
  > "$OUT/hf_train_step.txt" 2>&1; echo "train step rc=$?"; tail -8 "$OUT/hf_train_step.txt"
