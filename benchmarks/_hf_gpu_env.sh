# Sourced by the HF GPU scripts (hf_model_cuda.sh, rl_loop_cuda.sh) on the GPU machine, with the commit as $1:
# the FA4/transformers environment, and $OUT/machine.txt (commit, GPU, driver, torch/triton/transformers).
set -u -o pipefail
source /opt/rlk/env.sh
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
{ echo "commit ${1:-unknown}"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader;
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__)"; } > "$OUT/machine.txt" 2>&1
