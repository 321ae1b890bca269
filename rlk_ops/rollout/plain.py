"""The negative control: the same model run the way a typical rollout engine runs it.

Plain PyTorch on the rollout side: ``F.linear`` (BLAS picks its kernel from the
batch's row count), Hugging Face-style RoPE (cos/sin rounded to the model dtype),
SDPA over each step's K/V gathered and padded to the longest sequence in the batch,
``F.silu`` and ``torch.log_softmax``. Same weights, same tokens, same scheduling as
the rlk rollout. It exists to show that the train-vs-rollout comparison can fail:
its log-probs differ from the training side's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from rlk_ops.rollout.model import TinyQwen3, Trace


def _rmsnorm(x, w, eps):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x, positions, theta):
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    freqs = positions.float()[..., None] * inv_freq.to(x.device)
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos().to(x.dtype)[..., None, :], emb.sin().to(x.dtype)[..., None, :]
    rot = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + rot * sin


def plain_forward_rollout(model: TinyQwen3, tokens, positions, cache, seqs, slot_mapping, trace: Trace | None = None):
    cfg = model.config
    b, sq = tokens.shape
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    h = model.embed_tokens(tokens)
    lens = cache.seq_lens(seqs).tolist()
    tables = cache.page_table(seqs).long()
    ps = cache.page_size
    kmax = max(lens)
    for i, layer in enumerate(model.layers):
        att = layer.self_attn
        x = _rmsnorm(h, layer.input_layernorm.weight, cfg.rms_norm_eps)
        q = _rmsnorm(F.linear(x, att.q_proj.weight).view(b, sq, hq, d), att.q_norm.weight, cfg.rms_norm_eps)
        k = _rmsnorm(F.linear(x, att.k_proj.weight).view(b, sq, hkv, d), att.k_norm.weight, cfg.rms_norm_eps)
        v = F.linear(x, att.v_proj.weight).view(b, sq, hkv, d)
        q, k = _rope(q, positions, cfg.rope_theta), _rope(k, positions, cfg.rope_theta)
        cache.k[i].view(-1, hkv, d)[slot_mapping] = k.reshape(-1, hkv, d)
        cache.v[i].view(-1, hkv, d)[slot_mapping] = v.reshape(-1, hkv, d)
        pos = torch.arange(kmax, device=tokens.device)
        slots = tables[:, (pos // ps).clamp(max=tables.shape[1] - 1)] * ps + pos % ps   # [B, kmax]
        keys = cache.k[i].view(-1, hkv, d)[slots].repeat_interleave(hq // hkv, 2)   # [B, kmax, Hq, D]
        vals = cache.v[i].view(-1, hkv, d)[slots].repeat_interleave(hq // hkv, 2)
        mask = pos.view(1, 1, -1) <= positions.view(b, sq, 1)                          # causal + padding
        o = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), vals.transpose(1, 2),
                                           attn_mask=mask[:, None])
        o = o.transpose(1, 2)
        if trace is not None:
            s = torch.einsum("bqhd,bkhd->bhqk", q.float(), keys.float()) * d ** -0.5
            lse = torch.logsumexp(s.masked_fill(~mask[:, None], float("-inf")), -1)
            trace.attn.append(o.reshape(b * sq, hq, d))
            trace.lse.append(lse.permute(0, 2, 1).reshape(b * sq, hq))
        h = h + F.linear(o.reshape(b, sq, hq * d), att.o_proj.weight)
        x = _rmsnorm(h, layer.post_attention_layernorm.weight, cfg.rms_norm_eps)
        mlp = layer.mlp
        h = h + F.linear(F.silu(F.linear(x, mlp.gate_proj.weight)) * F.linear(x, mlp.up_proj.weight),
                         mlp.down_proj.weight)
    return F.linear(_rmsnorm(h, model.norm.weight, cfg.rms_norm_eps), model.lm_head.weight)


def plain_log_softmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), -1).cpu()
