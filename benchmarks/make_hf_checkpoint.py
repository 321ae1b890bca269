"""Writes a random transformers Qwen3 checkpoint with ``save_pretrained`` (bf16 safetensors), for
``python -m rlk_ops demo --hf-model DIR`` on a machine that cannot download one.

    python -m benchmarks.make_hf_checkpoint DIR [--shape qwen3-0.6b | tiny]

qwen3-0.6b: Qwen3-0.6B's config (28 layers, hidden 1024, intermediate 3072, 16/8 heads, head_dim 128,
vocab 151936, theta 1e6, eps 1e-6, tied embeddings) with transformers' own random initialisation; the
layer norms' weights moved off 1 (seeded) so a norm that went missing shows. tiny: 2 layers of head_dim
128 (FA4's tiles) and a 1024-token vocabulary."""
from __future__ import annotations

import argparse

import torch

SHAPES = {
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128),
    "tiny": dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=128),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    import transformers

    cfg = transformers.Qwen3Config(**SHAPES[args.shape], max_position_embeddings=40960, rms_norm_eps=1e-6,
                                   tie_word_embeddings=True)
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 1e6}
    torch.manual_seed(args.seed)
    model = transformers.Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    model.to(torch.bfloat16).save_pretrained(args.out)
    print(f"wrote a random {args.shape} Qwen3 checkpoint ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M "
          f"parameters) to {args.out}")


if __name__ == "__main__":
    main()
