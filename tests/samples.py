"""One small sample input per rlk op, used by opcheck and the registry coverage test.

Every op in ``rlk_ops.meta.specs.REGISTRY`` must have an entry here (test_registry
enforces it), so a new op cannot skip opcheck.
"""
import math

import torch


def _paged(dtype=torch.float32, page_size=4, h_kv=2, d=8):
    num_pages = 6
    k_cache = torch.randn(num_pages, page_size, h_kv, d, dtype=dtype)
    v_cache = torch.randn(num_pages, page_size, h_kv, d, dtype=dtype)
    page_table = torch.tensor([[4, 1, 0], [2, 5, 3]], dtype=torch.int32)
    seq_lens = torch.tensor([9, 6], dtype=torch.int32)
    return k_cache, v_cache, page_table, seq_lens


def _permuted(t):
    """The same values in dense storage with its first two dims swapped in memory: an op whose
    output keeps its input's strides (clone, zeros_like) disagrees with its contiguous fake."""
    return t.transpose(0, 1).contiguous().transpose(0, 1)


def samples(group_name: str | None = None) -> dict[str, list[tuple]]:
    f32 = torch.float32
    x = torch.randn(5, 3, 8)
    w = torch.randn(8)
    pos = torch.arange(5, dtype=torch.int64) * 7
    q = torch.randn(2, 6, 4, 8)
    k = torch.randn(2, 9, 2, 8)
    v = torch.randn(2, 9, 2, 8)
    out, lse = torch.ops.rlk.attention_fwd(q, k, v, 1, 0.3, None, None, 0, 0, "disabled")
    qv = torch.randn(11, 4, 8)
    kvv = torch.randn(13, 2, 8)
    vvv = torch.randn(13, 2, 8)
    cu_q = torch.tensor([0, 5, 11], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 13], dtype=torch.int32)
    outv, lsev = torch.ops.rlk.attention_fwd(qv, kvv, vvv, 1, 0.3, cu_q, cu_k, 6, 7, "disabled")
    k_cache, v_cache, page_table, seq_lens = _paged()
    # canonical:128 needs > 128 keys to split: 3 queries at positions 128..130 of 131 keys
    qc, kc, vc = torch.randn(1, 3, 2, 8), torch.randn(1, 131, 1, 8), torch.randn(1, 131, 1, 8)
    outc, lsec = torch.ops.rlk.attention_fwd(qc, kc, vc, 1, 0.3, None, None, 0, 0, "canonical:128")
    kcc, vcc, ptc = torch.randn(10, 16, 1, 8), torch.randn(10, 16, 1, 8), torch.tensor([[3, 1, 4, 0, 9, 2, 6, 8, 5]],
                                                                                       dtype=torch.int32)
    states = torch.randn(3, 2, 5, 4, 8), torch.randn(3, 2, 4, 5)
    states[1][1, 0, 2, 3] = -math.inf  # an empty state
    merged = torch.ops.rlk.merge_attn_states(*states)
    xl = torch.randn(3, 5, 16)
    wl = torch.randn(12, 16)
    bl = torch.randn(12)
    dyl = torch.randn(3, 5, 12)
    s = {
        "qk_rmsnorm": [(x, w, 1e-6), (_permuted(x), w, 1e-6)],
        # dy in a layout of its own (the CPU kernel's dx kept dy's strides against the contiguous fake; a
        # session 38 audit)
        "qk_rmsnorm_bwd": [(torch.randn_like(x), x, w, 1e-6), (_permuted(torch.randn_like(x)), _permuted(x), w, 1e-6),
                           (torch.randn(8, 3, 5).permute(2, 1, 0), x, w, 1e-6)],
        "rope": [(x, pos, 1e6, 8), (x, pos, 1e4, 4), (_permuted(x), pos, 1e4, 8)],
        "rope_bwd": [(torch.randn_like(x), pos, 1e6, 8), (_permuted(torch.randn_like(x)), pos, 1e4, 8)],
        "paged_kv_append": [(k_cache.clone(), v_cache.clone(), torch.randn(3, 2, 8), torch.randn(3, 2, 8),
                             torch.tensor([5, -1, 17], dtype=torch.int64)),
                            # with the placement it is checked against: seq 0's token 8, seq 1's token 5
                            (k_cache.clone(), v_cache.clone(), torch.randn(2, 2, 8), torch.randn(2, 2, 8),
                             torch.tensor([0, 21], dtype=torch.int64), page_table, seq_lens,
                             torch.tensor([[8], [5]]))],
        # a cache whose head_dim is not its innermost dim (an HND buffer viewed as NHD; a session 38 audit)
        "paged_kv_gather": [(k_cache, v_cache, page_table, seq_lens),
                            (k_cache.transpose(-1, -2).contiguous().transpose(-1, -2), v_cache, page_table, seq_lens)],
        "attention_fwd": [(q, k, v, 1, 0.3, None, None, 0, 0, "disabled"), (q, k, v, 0, 0.3, None, None, 0, 0, "disabled"),
                          (qv, kvv, vvv, 1, 0.3, cu_q, cu_k, 6, 7, "disabled"),
                          (qc, kc, vc, 1, 0.3, None, None, 0, 0, "canonical:128"),
                          (_permuted(q), _permuted(k), _permuted(v), 1, 0.3, None, None, 0, 0, "disabled")],
        "attention_bwd": [(torch.randn_like(out), q, k, v, out, lse, None, 1, 0.3, None, None, 0, 0, "disabled"),
                          (torch.randn_like(out), q, k, v, out, lse, torch.randn_like(lse), 1, 0.3, None, None, 0, 0, "disabled"),
                          (torch.randn_like(outv), qv, kvv, vvv, outv, lsev, None, 1, 0.3, cu_q, cu_k, 6, 7, "disabled"),
                          (torch.randn_like(outc), qc, kc, vc, outc, lsec, torch.randn_like(lsec), 1, 0.3, None, None,
                           0, 0, "canonical:128"),
                          (_permuted(torch.randn_like(outv)), _permuted(qv), _permuted(kvv), _permuted(vvv), outv, lsev,
                           None, 1, 0.3, cu_q, cu_k, 6, 7, "disabled"),
                          (_permuted(torch.randn_like(out)), _permuted(q), _permuted(k), _permuted(v), out, lse, None, 1,
                           0.3, None, None, 0, 0, "disabled")],
        "paged_attention": [(torch.randn(2, 3, 4, 8), k_cache, v_cache, page_table, seq_lens, 0.3, "disabled"),
                            (torch.randn(1, 1, 2, 8), kcc, vcc, ptc, torch.tensor([140], dtype=torch.int32), 0.3,
                             "canonical:128"),  # decode: (chunk, sequence) pairs
                            (torch.randn(1, 13, 2, 8), kcc, vcc, ptc, torch.tensor([140], dtype=torch.int32), 0.3,
                             "canonical:128")],  # chunked prefill: the general plan
        "merge_attn_states": [states, (states[0][:, 0], states[1][:, 0]), (_permuted(states[0]), states[1])],
        "merge_attn_states_bwd": [(torch.randn_like(merged[0]), torch.randn_like(merged[1]), *states, *merged),
                                  (torch.randn_like(merged[0]), None, *states, *merged)],
        "paged_attention_auto": [(torch.randn(2, 3, 4, 8), k_cache, v_cache, page_table, seq_lens, 0.3)],
        "qk_norm_rope": [(x, torch.randn(5, 2, 8), w, torch.randn(8), pos, 1e-6, 1e6, 8),
                         (x, torch.randn(5, 2, 8), w, torch.randn(8), pos, 1e-5, 1e4, 4),
                         (_permuted(x), _permuted(torch.randn(5, 2, 8)), w, torch.randn(8), pos, 1e-6, 1e4, 8)],
        "linear": [(xl, wl, bl), (xl, wl, None), (_permuted(xl), wl, bl)],
        "linear_bwd": [(dyl, xl, wl), (_permuted(dyl), _permuted(xl), wl)],
        "linear_bias_bwd": [(dyl,)],
    }
    if group_name is not None:
        s["all_gather"] = [(torch.randn(3, 4), 0, group_name), (torch.randn(3, 4), -1, group_name)]
        s["reduce_scatter"] = [(torch.randn(4, 6, dtype=f32), 1, group_name)]
    return s


# which arguments opcheck should mark requires_grad (float tensors of differentiable ops)
DIFFERENTIABLE = {"qk_rmsnorm", "rope", "attention_fwd", "linear", "all_gather", "reduce_scatter", "qk_norm_rope",
                  "merge_attn_states"}

# ops that refuse to run in strict mode (diagnostic lanes): opcheck runs them inside strict(False)
NON_STRICT = {"paged_attention_auto"}
