"""A small Qwen3-style causal LM on rlk ops, for the train-vs-rollout check.

    embedding -> N x [RMSNorm -> Qwen3Attention -> +residual -> RMSNorm -> SwiGLU MLP -> +residual]
              -> RMSNorm -> lm_head -> log-softmax

Random weights from a seed (nothing is downloaded). Two entry points share them:
``forward_train`` (one packed, teacher-forced varlen batch) and ``forward_rollout``
(newest tokens of a batch of sequences over the paged cache).

The model-level glue is chosen so that it cannot break batch invariance either:
residual adds and the SwiGLU product are elementwise single IEEE operations; SiLU and
log-softmax use ``numerics.exp`` / ``numerics.log`` (``torch.nn.functional.silu``
and ``torch.log_softmax`` on CPU evaluate exp differently in the vector body and the
scalar tail of a row, and on CUDA ``log_softmax``'s reduction split depends on the
number of rows), so log-probs are computed by the CPU reference path, or on CUDA by a Triton kernel
with the same exp and log, one program per row (``glue.lse_rows``; trainer and rollout use the same one).
And it cannot break compiled == eager: the SwiGLU is an op of its own (``glue.py``: Inductor
changed its bits as plain code), and each residual add is one rounding whose result an rlk op reads.
"""
from __future__ import annotations

import types
from dataclasses import dataclass, field

import torch
from torch import nn

import rlk_ops
from rlk_ops.compile.block import Qwen3Attention, Qwen3AttentionConfig
from rlk_ops.compile.module_checks import check_autocast, check_weight_modules
from rlk_ops.ops import _validate as V
from rlk_ops.ops._validate import positive_ints
from rlk_ops.rollout.glue import check_temperature, lse_rows, silu, swiglu  # noqa: F401 (silu: re-exported)


@dataclass(frozen=True)
class TinyQwen3Config:
    vocab_size: int = 512
    hidden_size: int = 256
    intermediate_size: int = 512
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-6
    split_kv: str = "disabled"

    def __post_init__(self):
        positive_ints("TinyQwen3Config", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                      intermediate_size=self.intermediate_size, num_layers=self.num_layers)
        self.attention()  # the attention block's own checks, at construction

    def attention(self) -> Qwen3AttentionConfig:
        return Qwen3AttentionConfig(self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim,
                                    self.rope_theta, self.rms_norm_eps, split_kv=self.split_kv)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / temperature)[token] per row: logits [T, V], tokens [T] -> fp32 [T] on logits'
    device, the rollout's ``log_softmax`` bits at the token (the CPU reference path, or the Triton kernel for
    CUDA logits: module doc).
    Differentiable (``rlk_model::token_logprobs``, ``glue.py``), so a trainer's loss reads the log-probs the
    rollout sampled with, bit for bit: an on-policy importance ratio exp(logp - rollout_logp) is exactly 1.
    ``temperature``: the rollout sampler's (its recorded log-probs are the tempered distribution's)."""
    for name, value in (("logits", logits), ("tokens", tokens)):
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"token_logprobs: {name} must be a tensor, got {type(value).__name__}")
    return torch.ops.rlk_model.token_logprobs(logits, tokens.to(logits.device),
                                              float(check_temperature("", temperature)))[0]


def log_softmax(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / temperature) over the last dim, fp32, on the host (the rollout engine's
    log-probs, which its sampler reads): z - lse with ``glue.lse_rows``' z and lse, computed on the GPU for
    CUDA logits (the Triton kernel ``token_logprobs`` uses there) and on the CPU reference path otherwise."""
    x = logits.detach()
    z, lse = lse_rows(x.reshape(-1, x.shape[-1]), float(check_temperature("", temperature)), "log_softmax")
    return (z - lse[:, None]).reshape(*x.shape[:-1], x.shape[-1]).cpu()


class _RMSNorm(nn.Module):
    def __init__(self, dim, eps, **f):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, **f))
        self.eps = eps

    def forward(self, x):
        return rlk_ops.qk_rmsnorm(x, self.weight, self.eps)  # Qwen3RMSNorm over the last dim

    @classmethod
    def sharing(cls, weight: nn.Parameter, eps: float) -> "_RMSNorm":
        """A norm over another module's weight ``Parameter`` (shared, not copied)."""
        norm = cls.__new__(cls)
        nn.Module.__init__(norm)
        norm.weight, norm.eps = weight, eps
        return norm


class RlkEmbedding(nn.Embedding):
    """An ``nn.Embedding`` whose forward is ``rlk_model::embedding`` (``glue.py``): the same gather, and a
    backward whose sums over repeated ids are fixed, so eager and torch.compile give the same gradient. Not
    supported (refused): ``max_norm`` (it renormalises the weight in place), ``scale_grad_by_freq``,
    ``sparse``."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self._check()
        return torch.ops.rlk_model.embedding(self.weight, ids, -1 if self.padding_idx is None else self.padding_idx)

    def _check(self, where: str = "RlkEmbedding") -> None:
        self.check_settings(where, self)

    @staticmethod
    def check_settings(where: str, emb: nn.Embedding, path: str = "") -> None:
        """Refuses an embedding setting the rlk embedding does not support, naming it (``path``: the
        module's, as a prefix)."""
        for name, off in (("max_norm", None), ("scale_grad_by_freq", False), ("sparse", False)):
            if getattr(emb, name) != off:
                raise V.RlkInputError(f"{where}: {path}{name} must be {off} (the rlk embedding does not support "
                                      f"it), got {getattr(emb, name)!r}")

    @classmethod
    def sharing(cls, emb: nn.Embedding) -> "RlkEmbedding":
        """An rlk embedding over another ``nn.Embedding``'s weight ``Parameter`` (shared, not copied) and its
        settings; refuses the settings it does not support."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        for name in ("num_embeddings", "embedding_dim", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq",
                     "sparse"):
            setattr(new, name, getattr(emb, name))
        new._check("RlkEmbedding.sharing")
        new.weight = emb.weight
        return new.train(emb.training)


class _MLP(nn.Module):
    def __init__(self, hidden, inter, **f):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False, **f)
        self.up_proj = nn.Linear(hidden, inter, bias=False, **f)
        self.down_proj = nn.Linear(inter, hidden, bias=False, **f)

    def forward(self, x):
        check_weight_modules("TinyQwen3 mlp", self, ("gate_proj", "up_proj", "down_proj"), nn.Linear)
        gate_up = rlk_ops.linear(x, torch.cat([self.gate_proj.weight, self.up_proj.weight]))
        return rlk_ops.linear(swiglu(gate_up), self.down_proj.weight)   # an op: compiled bits = eager bits

    @classmethod
    def sharing(cls, gate_proj: nn.Linear, up_proj: nn.Linear, down_proj: nn.Linear) -> "_MLP":
        """An MLP over another module's ``nn.Linear`` modules (shared, not copied)."""
        mlp = cls.__new__(cls)
        nn.Module.__init__(mlp)
        mlp.gate_proj, mlp.up_proj, mlp.down_proj = gate_proj, up_proj, down_proj
        return mlp


class _Layer(nn.Module):
    def __init__(self, cfg: TinyQwen3Config, **f):
        super().__init__()
        self.input_layernorm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **f)
        self.self_attn = Qwen3Attention(cfg.attention(), **f)
        self.post_attention_layernorm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **f)
        self.mlp = _MLP(cfg.hidden_size, cfg.intermediate_size, **f)


@dataclass
class Trace:
    """Per-layer attention output and lse of every token a forward processed."""
    attn: list[torch.Tensor] = field(default_factory=list)  # per layer: [N, Hq, D]
    lse: list[torch.Tensor] = field(default_factory=list)   # per layer: [N, Hq]


class TinyQwen3(nn.Module):
    def __init__(self, cfg: TinyQwen3Config | None = None, *, dtype=torch.bfloat16, device="cpu", seed: int = 0):
        super().__init__()
        self.config = cfg = cfg or TinyQwen3Config()
        f = {"dtype": dtype, "device": device}
        self.embed_tokens = RlkEmbedding(cfg.vocab_size, cfg.hidden_size, **f)
        self.layers = nn.ModuleList(_Layer(cfg, **f) for _ in range(cfg.num_layers))
        self.norm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **f)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, **f)
        self._init(seed)

    def _init(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    val = 1 + 0.1 * torch.randn(p.shape, generator=g)
                elif name.startswith("embed_tokens"):
                    val = torch.randn(p.shape, generator=g)
                else:
                    val = torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5
                p.copy_(val)

    # ---------------------------------------------------------------- training
    def forward_train(self, tokens: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor,
                      max_seqlen: int = 0, trace: Trace | None = None) -> torch.Tensor:
        """tokens/positions [T] (packed), cu_seqlens int32 [B+1] -> logits [T, vocab]."""
        if not torch.compiler.is_compiling():
            self.check_tokens("TinyQwen3.forward_train", tokens, "[T] (packed)")
        self._check_setup("TinyQwen3.forward_train", tokens)
        h = self.embed_tokens(tokens)
        for layer in self.layers:
            out, attn, lse = self._train_attention(layer)(layer.input_layernorm(h), positions, cu_seqlens,
                                                          max_seqlen, return_attention=True)
            if trace is not None:
                trace.attn.append(attn.detach())
                trace.lse.append(lse.detach().t())
            h = h + out
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return rlk_ops.linear(self.norm(h), self.lm_head.weight)

    @staticmethod
    def _train_attention(layer: nn.Module):
        """What ``forward_train`` calls for a layer's attention: the block module itself (its hooks run)."""
        return layer.self_attn

    # ----------------------------------------------------------------- rollout
    def forward_rollout(self, tokens: torch.Tensor, positions: torch.Tensor, cache, seqs: list[int],
                        slot_mapping: torch.Tensor, trace: Trace | None = None) -> torch.Tensor:
        """tokens/positions [B, Sq]: the newest Sq tokens of sequences ``seqs`` (their
        slots already reserved in ``cache``) -> logits [B, Sq, vocab]."""
        return self.forward_paged(tokens, positions, cache.k, cache.v, cache.page_table(seqs), cache.seq_lens(seqs),
                                  slot_mapping, trace)

    def forward_paged(self, tokens: torch.Tensor, positions: torch.Tensor, k_caches: list[torch.Tensor],
                      v_caches: list[torch.Tensor], page_table: torch.Tensor, seq_lens: torch.Tensor,
                      slot_mapping: torch.Tensor, trace: Trace | None = None) -> torch.Tensor:
        """``forward_rollout`` after the allocator's lookups: tensors only (what ``compiled_rollout``
        compiles; Dynamo would guard on the allocator's Python tables and compile anew every step).
        Eagerly, the tokens and the per-layer caches are checked before any layer writes its cache
        (``compiled_rollout`` checks them before the compiled call)."""
        if not torch.compiler.is_compiling():
            self.check_paged_inputs(tokens, k_caches, v_caches)
        self._check_setup("TinyQwen3.forward_paged", tokens)
        b, sq = tokens.shape
        h = self.embed_tokens(tokens)
        for i, layer in enumerate(self.layers):
            out, attn, lse = layer.self_attn.forward_rollout(
                layer.input_layernorm(h), positions, k_caches[i], v_caches[i], page_table, seq_lens, slot_mapping,
                return_attention=True)
            if trace is not None:
                trace.attn.append(attn.reshape(b * sq, *attn.shape[2:]))
                trace.lse.append(lse.permute(0, 2, 1).reshape(b * sq, lse.shape[1]))
            h = h + out
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return rlk_ops.linear(self.norm(h), self.lm_head.weight)

    # ------------------------------------------------------------------ checks
    def _check_setup(self, where: str, tokens: torch.Tensor) -> None:
        """lm_head is read, not called; rlk ops do not autocast (``compile/module_checks.py``)."""
        check_weight_modules(where, self, ("lm_head",), nn.Linear)
        check_autocast(where, tokens.device.type, self.lm_head.weight.dtype)

    def check_tokens(self, where: str, tokens, layout: str, dims: int = 1) -> None:
        """tokens: an integer tensor of ``dims`` dims, every value in [0, vocab_size) (the embedding's own
        errors name neither the argument nor the value; CUDA values checked as the ops check theirs)."""
        vocab = self.config.vocab_size
        if not isinstance(tokens, torch.Tensor):
            raise V.RlkInputError(f"{where}: tokens must be a torch.Tensor {layout}, got {type(tokens).__name__}")
        if tokens.dtype not in (torch.int64, torch.int32):
            raise V.RlkInputError(f"{where}: tokens must be torch.int64 or torch.int32 token ids, got {tokens.dtype}")
        if tokens.dim() != dims:
            raise V.RlkInputError(f"{where}: tokens must be {dims}-D {layout}, got shape {V.shape_str(tokens)}")
        if tokens.device != self.embed_tokens.weight.device:
            raise V.RlkInputError(f"{where}: tokens must be on the model's device "
                                  f"{self.embed_tokens.weight.device}, got {tokens.device}")
        V.token_ids_in_range(where, "tokens", tokens, vocab, "the vocabulary")

    def check_paged_inputs(self, tokens, k_caches, v_caches) -> None:
        """``forward_paged``'s tokens [B, Sq] and caches: one K and one V cache per layer, each
        [num_pages, page_size, num_kv_heads, head_dim] in the dtype and on the device of what the layer's k
        projection makes, and no two sharing memory (``[torch.zeros(shape)] * num_layers`` made every layer
        write one cache: accepted, logits wrong, a session 38 audit). Checked before any layer writes: a
        bad later layer was found after layer 0 had written its cache."""
        where = "TinyQwen3.forward_paged"
        self.check_tokens(where, tokens, "[B, Sq] (the newest Sq tokens of B sequences)", dims=2)
        cfg = self.config
        for name, caches in (("k_caches", k_caches), ("v_caches", v_caches)):
            if not isinstance(caches, (list, tuple)) or len(caches) != cfg.num_layers:
                got = f"{type(caches).__name__} of {len(caches)}" if isinstance(caches, (list, tuple)) else \
                    type(caches).__name__
                raise V.RlkInputError(f"{where}: {name} must be a list of {cfg.num_layers} caches (one per layer), "
                                      f"got {got}")
        # each layer's caches hold what its k projection makes (an embedding table may have another dtype)
        named = [(f"{name}[{i}]", caches[i], k_weight(self.layers[i].self_attn))
                 for i in range(cfg.num_layers) for name, caches in (("k_caches", k_caches), ("v_caches", v_caches))]
        first = None
        for name, c, w in named:
            if not isinstance(c, torch.Tensor):
                raise V.RlkInputError(f"{where}: {name} must be a torch.Tensor, got {type(c).__name__}")
            if c.dim() != 4 or tuple(c.shape[2:]) != (cfg.num_kv_heads, cfg.head_dim):
                raise V.RlkInputError(f"{where}: {name} must be [num_pages, page_size, {cfg.num_kv_heads}, "
                                      f"{cfg.head_dim}] (num_kv_heads, head_dim), got shape {V.shape_str(c)}")
            if first is not None and c.shape != first[1].shape:
                raise V.RlkInputError(f"{where}: {name} must have {first[0]}'s shape {V.shape_str(first[1])} "
                                      f"(every layer's cache has one layout), got {V.shape_str(c)}")
            if w is not None and (c.dtype != w.dtype or c.device != w.device):
                raise V.RlkInputError(f"{where}: {name} must have the dtype and device of what its layer's k_proj "
                                      f"makes, {w.dtype} on {w.device}, got {c.dtype} on {c.device}")
            first = first or (name, c)
        spans = sorted((V.span(c), name) for name, c, _ in named if c.numel())
        for (a, name_a), (b, name_b) in zip(spans, spans[1:]):
            if b[0] < a[1]:
                raise V.RlkInputError(f"{where}: {name_b} shares memory with {name_a}; each layer's K and V need "
                                      "caches of their own (one tensor for several would have each layer "
                                      "overwrite another's keys)")


def k_weight(attn: nn.Module) -> torch.Tensor | None:
    """The weight that makes a layer's keys: ``k_proj``'s, or a packed ``qkv_proj``'s (vLLM's layout);
    None for a module with neither (its caches' dtype is then left to the append's check)."""
    for name in ("k_proj", "qkv_proj"):
        w = getattr(getattr(attn, name, None), "weight", None)
        if isinstance(w, torch.Tensor):
            return w
    return None


def compiled_rollout(**compile_kwargs):
    """A ``forward=`` for ``RolloutEngine``: the allocator's lookups (page table, lengths) run eagerly,
    ``TinyQwen3.forward_paged`` under ``torch.compile(**compile_kwargs)``. Compiling
    ``forward_rollout`` whole compiled a graph per step (Dynamo guarded on the page tables' Python
    lists: 35 graphs for 32 steps); this compiled 5 for 72 steps in tests/test_rollout.py, with the
    eager trainer's bits. Dynamo still specialises sizes of 1 (a batch of one sequence, one new
    token) and sizes equal to another (duck sizing), so a run compiles a few graphs. A one-column
    page table gets a second column (page 0, past every sequence's length: read by no row)."""
    # a function of its own (a copy of the code object): Dynamo counts its recompile limit (8) per code
    # object, so every compiled_rollout shared one and a process's third model ran eagerly (a session 35
    # review)
    fn = TinyQwen3.forward_paged
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    core = torch.compile(own, **compile_kwargs)

    def forward(model, tokens, positions, cache, seqs, slot_mapping, trace=None):
        model.check_paged_inputs(tokens, cache.k, cache.v)   # eager: the compiled core skips its own
        table = cache.page_table(seqs)
        if table.shape[1] == 1:
            table = torch.nn.functional.pad(table, (0, 1))
        return core(model, tokens, positions, cache.k, cache.v, table, cache.seq_lens(seqs), slot_mapping, trace)
    return forward
