"""One 'keys' decode-pair launch at batch 1 / 8k (page 16, 16/4 heads, d 128), for a profiler:
    ncu -k regex:_pair_decode_keys -c 1 --set full python3 benchmarks/profile_pair_decode.py [C] [warps stages]
The first launches compile; the profiled one is the last (ncu: --launch-skip)."""
import sys

import torch

from rlk_ops.kernels.triton.pair_decode import pair_decode

c = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
cfg = (int(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) > 3 else (4, 3)
gen = torch.Generator(device="cuda").manual_seed(0)
ps, hq, hkv, d, ctx = 16, 16, 4, 128, 8192
n = ctx // ps
kc = torch.randn(n, ps, hkv, d, device="cuda", generator=gen).to(torch.bfloat16)
vc = torch.randn(n, ps, hkv, d, device="cuda", generator=gen).to(torch.bfloat16)
pt = torch.randperm(n, device="cuda", generator=gen).to(torch.int32).view(1, n)
sl = torch.full((1,), ctx, dtype=torch.int32, device="cuda")
q = torch.randn(1, 1, hq, d, device="cuda", generator=gen).to(torch.bfloat16)
for _ in range(3):
    pair_decode(q, kc, vc, pt, sl, d ** -0.5, c, config=cfg, layout="keys")
torch.cuda.synchronize()
print("done", c, cfg)
