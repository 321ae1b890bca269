"""The Qwen3 attention block built only from rlk ops.

    x -> rlk::linear (fused QKV) -> rlk::qk_rmsnorm (q_norm, k_norm) -> rlk::rope
      -> training: rlk::attention_fwd on a packed varlen batch
         rollout:  rlk::paged_kv_append + rlk::paged_attention (chunked prefill, decode)
      -> rlk::linear (o_proj)

Parameters carry Hugging Face Qwen3 names (``q_proj``, ``k_proj``, ``v_proj``,
``o_proj``, ``q_norm``, ``k_norm``), so the ``self_attn.*`` entries of an HF Qwen3
state dict load directly. Defaults are the Qwen3-8B TP=2 local shard.

Why one fused QKV ``rlk::linear`` over ``cat([Wq, Wk, Wv])`` instead of three: with
three projections of the same ``x``, autograd sums three partial dx in the backward
graph with ``aten.add``, a compute node outside any rlk op that Inductor fuses into
one fp32 sum (eager rounds each add to bf16), so compiled and eager gradients would
differ. The concatenation is a copy (exact); its backward is a split (views). A
row's result is the same either way (each output element reduces over K alone).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
from torch import nn

import rlk_ops
from rlk_ops.compile.module_checks import check_autocast, check_weight_modules
from rlk_ops.kernels.dispatch import kernel_for
from rlk_ops.meta.contract import SplitKVPolicy, spell
from rlk_ops.ops._validate import FLOAT_DTYPES, finite, positive_ints, short_repr


@dataclass(frozen=True)
class Qwen3AttentionConfig:
    hidden_size: int = 4096
    num_heads: int = 16
    num_kv_heads: int = 4
    head_dim: int = 128
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-6
    rotary_dim: int | None = None  # None: the whole head_dim (Qwen3)
    attention_bias: bool = False
    split_kv: str = "disabled"

    def __post_init__(self):
        # numpy scalars (a config read through numpy) as the Python numbers they stand for: np.int64(8) was
        # refused as "must be None or even and in (0, head_dim]" (a session 38 audit)
        for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "rotary_dim", "rope_theta",
                     "rms_norm_eps"):
            value = getattr(self, name)
            if isinstance(value, numbers.Real) and not isinstance(value, (bool, int, float)) \
                    and type(value).__module__ == "numpy":
                object.__setattr__(self, name, int(value) if isinstance(value, numbers.Integral) else float(value))
        positive_ints("Qwen3AttentionConfig", hidden_size=self.hidden_size, num_heads=self.num_heads,
                      num_kv_heads=self.num_kv_heads, head_dim=self.head_dim)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        # the ops check these again, but a config is built before the first (maybe compiled) forward
        if not (isinstance(self.rope_theta, (int, float)) and not isinstance(self.rope_theta, bool)
                and finite(self.rope_theta) and self.rope_theta >= 1):
            raise ValueError(f"Qwen3AttentionConfig rope_theta must be a finite number >= 1 (the RoPE base), got "
                             f"{short_repr(self.rope_theta)}")
        if not (isinstance(self.rms_norm_eps, (int, float)) and not isinstance(self.rms_norm_eps, bool)
                and finite(self.rms_norm_eps) and self.rms_norm_eps >= torch.finfo(torch.float32).tiny):
            # the op's rule for float32 accumulation (bf16/fp16/fp32 models): a normal float32
            raise ValueError(f"Qwen3AttentionConfig rms_norm_eps must be a finite number >= "
                             f"{torch.finfo(torch.float32).tiny} (the smallest normal float32), got "
                             f"{self.rms_norm_eps!r}")
        if not isinstance(self.attention_bias, bool):
            raise ValueError(f"Qwen3AttentionConfig attention_bias must be a bool, got {self.attention_bias!r}")
        rd = self.rotary_dim
        if rd is not None and (not isinstance(rd, int) or isinstance(rd, bool) or rd <= 0 or rd % 2
                               or rd > self.head_dim):
            raise ValueError(f"Qwen3AttentionConfig rotary_dim must be None or even and in (0, head_dim="
                             f"{self.head_dim}], got {rd!r}")
        if rd is None and self.head_dim % 2:   # else the first forward's rope named a rotary_dim nobody set
            raise ValueError(f"Qwen3AttentionConfig head_dim must be even when rotary_dim is None (RoPE rotates "
                             f"the whole head), got {self.head_dim}; or set an even rotary_dim < head_dim")
        policy = SplitKVPolicy.parse(spell(self.split_kv))  # raises with the policy's own message
        if policy.kind not in ("disabled", "canonical"):
            raise ValueError(f"Qwen3AttentionConfig split_kv must be 'disabled' or 'canonical:C' (what both the "
                             f"training forward and the rollout compute), got {self.split_kv!r}")


class _Norm(nn.Module):
    """Holds an RMSNorm weight under HF's name (``q_norm.weight``)."""

    def __init__(self, dim: int, **factory):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, **factory))


class Qwen3Attention(nn.Module):
    def __init__(self, config: Qwen3AttentionConfig | None = None, *, dtype=torch.bfloat16, device=None, **overrides):
        super().__init__()
        if config is not None and not isinstance(config, Qwen3AttentionConfig):
            raise ValueError(f"Qwen3Attention: config must be a Qwen3AttentionConfig or None (fields may also be "
                             f"passed as keywords), got {type(config).__name__}")
        if dtype not in FLOAT_DTYPES:   # float8 passed is_floating_point and failed inside nn.Linear's init
            raise ValueError(f"Qwen3Attention: dtype must be one the rlk ops take, one of "
                             f"{', '.join(str(d) for d in FLOAT_DTYPES)}, got {dtype!r}")
        cfg = config or Qwen3AttentionConfig()
        if overrides:
            cfg = Qwen3AttentionConfig(**{**cfg.__dict__, **overrides})
        self.config = cfg
        f = {"dtype": dtype, "device": device}
        h, hq, hkv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(h, hq * d, bias=cfg.attention_bias, **f)
        self.k_proj = nn.Linear(h, hkv * d, bias=cfg.attention_bias, **f)
        self.v_proj = nn.Linear(h, hkv * d, bias=cfg.attention_bias, **f)
        self.o_proj = nn.Linear(hq * d, h, bias=cfg.attention_bias, **f)  # HF Qwen3: all four projections
        self.q_norm = _Norm(d, **f)
        self.k_norm = _Norm(d, **f)

    # ------------------------------------------------------------------ shared
    def _check_hidden(self, hidden_states, ndim: int, layout: str, return_attention=False) -> None:
        """Shape metadata (also under torch.compile): the ops below would otherwise fail on
        a reshape that names none of the block's arguments."""
        if not isinstance(return_attention, bool):   # "no" returned the attention (a session 38 audit)
            raise ValueError(f"Qwen3Attention: return_attention must be a bool, got "
                             f"{type(return_attention).__name__} {short_repr(return_attention)}")
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != ndim \
                or hidden_states.shape[-1] != self.config.hidden_size:
            raise ValueError(f"Qwen3Attention: hidden_states must be {ndim}-D {layout} with hidden_size "
                             f"{self.config.hidden_size}, got {list(getattr(hidden_states, 'shape', []))}")
        # the block reads its modules' parameters and never calls them (o_proj here, the rest where _qkv reads
        # them); rlk ops do not autocast
        check_weight_modules("Qwen3Attention", self, ("o_proj",), nn.Linear)
        check_autocast("Qwen3Attention", hidden_states.device.type, self.o_proj.weight.dtype)

    def _qkv(self, x: torch.Tensor, positions: torch.Tensor):
        """x [N, hidden], positions [N] -> q [N, Hq, D], k, v [N, Hkv, D] (normed, rotated)."""
        cfg = self.config
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        check_weight_modules("Qwen3Attention", self, ("q_proj", "k_proj", "v_proj"), nn.Linear)
        check_weight_modules("Qwen3Attention", self, ("q_norm", "k_norm"), _Norm)
        weight = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
        bias = None
        if cfg.attention_bias:
            bias = torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias])
        qkv = rlk_ops.linear(x, weight, bias)
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        n = x.shape[0]
        q = rlk_ops.qk_rmsnorm(q.reshape(n, hq, d), self.q_norm.weight, cfg.rms_norm_eps)
        k = rlk_ops.qk_rmsnorm(k.reshape(n, hkv, d), self.k_norm.weight, cfg.rms_norm_eps)
        q = rlk_ops.rope(q, positions, cfg.rope_theta, cfg.rotary_dim)
        k = rlk_ops.rope(k, positions, cfg.rope_theta, cfg.rotary_dim)
        return q, k, v.reshape(n, hkv, d)

    # ---------------------------------------------------------------- training
    def forward(self, hidden_states: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor,
                max_seqlen: int = 0, return_attention: bool = False):
        """Training forward on a packed varlen batch.

        hidden_states [T, hidden], positions [T] int64, cu_seqlens int32 [B+1]
        (max_seqlen 0: derived inside the op; under torch.compile a max_seqlen that changes between
        calls is a symbol of the graph, not a recompile per value). Returns [T, hidden]; with
        ``return_attention`` also the attention output [T, Hq, D] and lse [Hq, T]."""
        self._check_hidden(hidden_states, 2, "[T, hidden_size]", return_attention)
        q, k, v = self._qkv(hidden_states, positions)
        attn, lse = rlk_ops.attention(q, k, v, causal=True, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                                      max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen,
                                      split_kv=self.config.split_kv)
        out = rlk_ops.linear(attn.reshape(attn.shape[0], attn.shape[1] * attn.shape[2]), self.o_proj.weight,
                             self.o_proj.bias)
        return (out, attn, lse) if return_attention else out

    forward_train = forward

    # ----------------------------------------------------------------- rollout
    def forward_rollout(self, hidden_states: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor,
                        slot_mapping: torch.Tensor, return_attention: bool = False):
        """Rollout forward over the paged cache: chunked prefill (Sq > 1) or decode (Sq = 1).

        hidden_states [B, Sq, hidden] are the newest Sq tokens of each sequence,
        positions [B, Sq] int64, slot_mapping [B*Sq] int64 (where their K/V go),
        page_table int32 [B, max_pages], seq_lens int32 [B] (cached tokens including
        these). Appends the new K/V, then attends. Returns [B, Sq, hidden] (and the
        attention output [B, Sq, Hq, D] and lse [B, Hq, Sq] with ``return_attention``).
        Not differentiable through attention (under grad mode only o_proj gets a gradient):
        train with ``forward``."""
        self._check_hidden(hidden_states, 3, "[B, Sq, hidden_size]", return_attention)
        b, sq, hidden = hidden_states.shape
        if not isinstance(positions, torch.Tensor) or tuple(positions.shape) != (b, sq):
            got = list(positions.shape) if isinstance(positions, torch.Tensor) else short_repr(positions)
            raise ValueError(f"Qwen3Attention: positions must be a tensor [B, Sq] = [{b}, {sq}] (hidden_states' "
                             f"leading shape), got {type(positions).__name__} {got}")
        # one row per sequence: a table of other rows was blamed on positions by the append's check (a
        # session 38 audit)
        for name, t, rank in (("page_table", page_table, 2), ("seq_lens", seq_lens, 1)):
            if not isinstance(t, torch.Tensor) or t.dim() != rank or t.shape[0] != b:
                want = f"[B, max_pages] = [{b}, ...]" if rank == 2 else f"[B] = [{b}]"
                got = list(t.shape) if isinstance(t, torch.Tensor) else short_repr(t)
                raise ValueError(f"Qwen3Attention: {name} must be a tensor {want} (one row per sequence of "
                                 f"hidden_states), got {type(t).__name__} {got}")
        if not torch.compiler.is_compiling() and hidden_states.device.type != "meta":   # (meta: the fakes run)
            # a paged-attention backend that cannot run here raises before the append writes the cache, not
            # after (a session 39 audit; compiled, the ops' own checks run when the graph runs)
            kernel_for("paged_attention", hidden_states.device)
        q, k, v = self._qkv(hidden_states.reshape(b * sq, hidden), positions.reshape(b * sq))
        # the cache holds values: under grad mode k and v carry the weights' history, which an
        # in-place write would graft onto the caller's cache
        # (with page_table, seq_lens and positions: the slots are checked against where those put the
        # new tokens, so a slot in another sequence's page is refused before the write)
        rlk_ops.paged_kv_append(k_cache, v_cache, k.detach(), v.detach(), slot_mapping, page_table, seq_lens,
                                positions)
        # rlk::paged_attention has no backward (the rollout side): q goes in detached, so under grad mode
        # the gradient reaches o_proj only, eager and compiled alike. Before, eager ran PyTorch's
        # no-autograd fallback and compiled gave q_proj, q_norm and the input exactly 0 (a session 33
        # audit). Train with forward().
        attn, lse = rlk_ops.paged_attention(q.detach().reshape(b, sq, *q.shape[1:]), k_cache, v_cache, page_table,
                                            seq_lens, split_kv=self.config.split_kv)
        out = rlk_ops.linear(attn.reshape(b * sq, attn.shape[2] * attn.shape[3]), self.o_proj.weight,
                             self.o_proj.bias).reshape(b, sq, hidden)
        return (out, attn, lse) if return_attention else out
