"""The model glue around the rlk ops as custom ops (namespace ``rlk_model``): opaque to torch.compile.

    rlk_model::swiglu(gate_up [..., 2I]) -> [..., I]        silu(gate) * up, gate_up's dtype
    rlk_model::swiglu_bwd(dout [..., I], gate_up) -> [..., 2I]
    rlk_model::token_logprobs, _bwd                          the log-prob at a token (below)
    rlk_model::embedding, _bwd                               the embedding gather and its fixed-order sums (below)

``silu(x)`` is x * sigmoid(x) in fp32 (fp64 for fp64) with position-independent exp
(``numerics.exp``), rounded once to x's dtype; the product is one IEEE multiply in that dtype. Written as plain torch code in
the model, Inductor fused it and changed its bits: it keeps silu's fp32 value instead of the
rounded one for the product, and evaluates exp's polynomial its own way. On CPU 9,023 of 32,768
SwiGLU outputs differed, compiled vs eager, and a rollout compiled as the engine suggests
(``torch.compile(TinyQwen3.forward_rollout)``) mismatched the eager trainer's log-probs on 7 of 7
tokens while every attention row still matched (a session 35 audit). As ops, these torch calls run
as written under any compile (eager, Inductor, any device), so the compiled model's log-probs are
the eager model's. The residual adds need no op: each is one rounding, and its result is an
input of an rlk op (the next RMSNorm), which Inductor must materialise in the model's dtype.

The backward is the analytic gradient: d_up = dout * silu(gate) (in the dtype, as autograd's
product rule), d_gate = dout * up (in the dtype) times silu'(gate) = s * (1 + gate * (1 - s)), s the
fp32 (fp64) sigmoid of the forward, rounded once; tests check it against gradcheck in fp64. These
are not rlk ops: no backend choice, no determinism spec beyond "the same torch calls on every call".
"""
from __future__ import annotations

import torch

from rlk_ops.kernels.cpu import numerics as nx
from rlk_ops.ops import _validate as V
from rlk_ops.ops._library import no_forward_ad


def _acc(x: torch.Tensor) -> torch.Tensor:
    """x in the accumulation dtype: fp64 for fp64, else fp32."""
    return x if x.dtype == torch.float64 else x.float()


def _silu_parts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x in the accumulation dtype and 1 + exp(-x): silu is their quotient, the sigmoid 1 over the second."""
    x32 = _acc(x)
    return x32, 1.0 + nx.exp(-x32)


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x) in fp32 (fp64 for fp64) with position-independent exp, rounded once."""
    x32, denom = _silu_parts(x)
    return (x32 / denom).to(x.dtype)


def _check(op: str, gate_up: torch.Tensor, dout: torch.Tensor | None = None) -> None:
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2:
        raise ValueError(f"rlk_model::{op}: gate_up must be [..., 2 * intermediate] (gate, then up), got "
                         f"shape {list(gate_up.shape)}")
    if not gate_up.is_floating_point():
        raise ValueError(f"rlk_model::{op}: gate_up must be a floating tensor, got {gate_up.dtype}")
    if dout is not None:
        want = [*gate_up.shape[:-1], gate_up.shape[-1] // 2]
        if dout.dtype != gate_up.dtype or list(dout.shape) != want:
            raise ValueError(f"rlk_model::{op}: dout must be {gate_up.dtype} {want} (the output's), got "
                             f"{dout.dtype} {list(dout.shape)}")


@torch.library.custom_op("rlk_model::swiglu", mutates_args=())
def _swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    no_forward_ad("rlk_model::swiglu")   # a backward only, like the rlk ops: a JVP would come back as 0
    _check("swiglu", gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    # contiguous, as the fake says: the product follows a permuted input's strides (a session 35 review:
    # opcheck and Inductor failed on a transposed gate_up)
    return (silu(gate) * up).contiguous()


@_swiglu.register_fake
def _swiglu_fake(gate_up):
    _check("swiglu", gate_up)
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


@torch.library.custom_op("rlk_model::swiglu_bwd", mutates_args=())
def _swiglu_bwd(dout: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    _check("swiglu_bwd", gate_up, dout)
    gate, up = gate_up.chunk(2, dim=-1)
    x32, denom = _silu_parts(gate)   # exp once, for silu (its forward bits) and the sigmoid
    s = 1.0 / denom
    d_up = dout * (x32 / denom).to(gate.dtype)
    d_gate = (_acc(dout * up) * (s * (1.0 + x32 * (1.0 - s)))).to(gate.dtype)
    return torch.cat([d_gate, d_up], dim=-1)


@_swiglu_bwd.register_fake
def _swiglu_bwd_fake(dout, gate_up):
    _check("swiglu_bwd", gate_up, dout)
    return gate_up.new_empty(gate_up.shape)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _backward(ctx, dout):
    (gate_up,) = ctx.saved_tensors
    return torch.ops.rlk_model.swiglu_bwd(dout.contiguous(), gate_up)


_swiglu.register_autograd(_backward, setup_context=_setup)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = cat([gate, up], -1); differentiable."""
    return torch.ops.rlk_model.swiglu(gate_up)


# ------------------------------------------------------------------ token log-probs
# rlk_model::token_logprobs(logits [T, V], tokens [T], temperature) -> (logp [T], lse [T])   fp32, logits' device
# rlk_model::token_logprobs_bwd(dlogp [T], dlse [T], logits, tokens, lse, temperature) -> dlogits [T, V]
#
# The log-prob of each row's token, log_softmax(logits / T)[token] = z[token] - lse with z = logits in fp32
# divided by the temperature T (one IEEE division per element: a sampler drawing from softmax(logits / T)
# has these log-probs; at T = 1, z = logits) and lse = max + log(rowsum(exp(z - max))): the rollout engine's
# arithmetic (``model.log_softmax``), bit for bit, so the trainer's differentiable log-prob is the rollout's.
# Two paths, chosen by the logits' device, each used by both sides:
#   * CPU (and any device but CUDA, through the host): ``row_lse``, position-independent exp and log and a
#     row sum in ATen's fixed order (torch.log_softmax's bits depend on the row's place in a vector loop);
#   * CUDA: the Triton kernel of kernels/triton/logprobs.py, one program per row (the same exp and log, its
#     own fixed order; torch.log_softmax's reduction split on CUDA depends on the number of rows), reading
#     the logits in their dtype on the device: no T x V copy to the host (session 46 made one).
# The two paths' bits differ (summation order), so a trainer and a rollout compare on the same device type.
# The backward, d z = dlogp * (onehot(token) - softmax) + dlse * softmax, runs on logits' device:
# elementwise, with no reduction, so deterministic and batch-invariant.


_CHUNK_ELEMENTS = 1 << 18   # logits elements per step of row_lse (1 MiB of fp32)


def row_lse(z: torch.Tensor) -> torch.Tensor:
    """max + log(rowsum(exp(z - max))) of each row of a CPU fp32 ``z`` [rows, V], a few rows at a time (the
    temporaries stay in cache: 4-5x faster at V = 151936 than over the whole matrix at once). The same bits
    either way: every operation is per element or per row (numerics.py)."""
    z = z.reshape(-1, z.shape[-1])
    lse = torch.empty(z.shape[0], dtype=z.dtype)
    step = max(1, _CHUNK_ELEMENTS // max(1, z.shape[1]))
    for i in range(0, z.shape[0], step):
        zc = z[i:i + step]
        m = zc.amax(-1, keepdim=True)
        lse[i:i + step] = m.squeeze(-1) + nx.log(nx.rowsum(nx.exp(zc - m)))
    return lse


def _check_logprobs(op: str, logits: torch.Tensor, tokens: torch.Tensor) -> None:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"rlk_model::{op}: logits must be a floating tensor [tokens, vocab], got "
                         f"{logits.dtype} {list(logits.shape)}")
    if tokens.dim() != 1 or tokens.shape[0] != logits.shape[0] or tokens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rlk_model::{op}: tokens must be int64 or int32 [{logits.shape[0]}] (one per logits row), "
                         f"got {tokens.dtype} {list(tokens.shape)}")
    if tokens.device != logits.device:
        raise ValueError(f"rlk_model::{op}: tokens must be on logits' device {logits.device}, got {tokens.device}")


def _token_values(op: str, tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """tokens on the CPU as int64, every value checked in [0, vocab) (else gather read another row's slot or
    raised an index error naming nothing)."""
    t = tokens.cpu().long()
    bad = (t < 0) | (t >= vocab)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(f"rlk_model::{op}: tokens[{i}] must be in [0, {vocab}) (the vocabulary), got {int(t[i])}")
    return t


def check_overflow(z: torch.Tensor, temperature: float, where: str) -> None:
    """Refuse a temperature at which z / temperature (fp32) overflows a finite logit, naming it (the
    log-probs would be NaN: inf - inf). A reduction and a division: z / T overflows at a finite z iff
    max |finite z| / T does (the division is monotone and rounds the same element the same way).
    Infinite logits (a masked vocabulary's -inf) stay what they are and are no overflow."""
    if temperature == 1.0 or z.numel() == 0:
        return
    z = z.detach()
    big = torch.where(torch.isfinite(z), z.abs(), 0).amax().to(torch.float32)
    if not bool(torch.isfinite(big / _divisor(temperature, big))):
        raise ValueError(f"{where}: temperature {temperature!r} overflows logits / temperature in torch.float32 "
                         f"(largest |logit| {float(big)!r}): the log-probs would be NaN; use a larger "
                         f"temperature (or a greedy sampler)")


def _divisor(temperature: float, z: torch.Tensor) -> torch.Tensor:
    """The temperature as a 0-dim tensor of z's dtype on z's device. Dividing by it is one IEEE division
    per element on every device; dividing a CUDA tensor by a Python float is not (ATen computes
    z * (1 / T) there, which differs from z / T in about half of the elements)."""
    return torch.tensor(temperature, dtype=z.dtype, device=z.device)


def tempered(z: torch.Tensor, temperature: float, where: str | None = None) -> torch.Tensor:
    """z / temperature in z's dtype (one IEEE division per element; z itself at temperature 1). With
    ``where``: a finite z that the division overflows is refused, naming the temperature
    (``check_overflow``)."""
    if temperature == 1.0:
        return z
    if where is not None:
        check_overflow(z, temperature, where)
    return z / _divisor(temperature, z)


def _cuda_kernels():
    """kernels/triton/logprobs.py, or a clear error: on CUDA the log-probs have no other path (the host
    path's bits differ from the kernel's, so a silent switch would put a trainer and its rollout apart)."""
    from rlk_ops.kernels.triton import _common

    if _common.INTERPRET:
        raise RuntimeError("the CUDA log-probs run a Triton kernel, and TRITON_INTERPRET=1 would run it in the "
                           "interpreter, whose bits are not the GPU's; unset TRITON_INTERPRET")
    try:
        from rlk_ops.kernels.triton import logprobs
    except ImportError as e:
        raise RuntimeError(f"the CUDA log-probs need triton (kernels/triton/logprobs.py), which cannot be "
                           f"imported: {e}") from e
    return logprobs


def lse_rows(logits: torch.Tensor, temperature: float, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(z, lse) of each row of ``logits`` [rows, V] at ``temperature``: z = logits / T in fp32 and its
    row lse, on the logits' device for CUDA (the Triton kernel; z computed by torch with the kernel's
    division), on the host otherwise (``row_lse``). The rollout engine's ``log_softmax`` is z - lse."""
    if logits.device.type == "cuda":
        check_overflow(logits, temperature, where)
        return tempered(logits.float(), temperature), _cuda_kernels().row_lse(logits, temperature)
    z = tempered(logits.float().cpu(), temperature, where)
    return z, row_lse(z)


def check_temperature(where: str, t):
    """A sampling temperature: a finite number > 0 (not a bool); returns it. ``where`` prefixes the error
    (the Sampler's, the log-prob functions' and these ops' one check)."""
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not (V.finite(t) and t > 0):
        raise ValueError(f"{where}temperature must be a finite number > 0, got {V.short_repr(t)}")
    return t


def _check_temperature(op: str, temperature: float) -> None:
    check_temperature(f"rlk_model::{op}: ", temperature)


@torch.library.custom_op("rlk_model::token_logprobs", mutates_args=())
def _token_logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                    temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    no_forward_ad("rlk_model::token_logprobs")
    _check_logprobs("token_logprobs", logits, tokens)
    _check_temperature("token_logprobs", temperature)
    t = _token_values("token_logprobs", tokens, logits.shape[1])
    if logits.device.type == "cuda":
        check_overflow(logits, temperature, "rlk_model::token_logprobs")
        return _cuda_kernels().token_logprobs(logits, tokens, temperature)
    z = tempered(logits.float().cpu(), temperature, "rlk_model::token_logprobs")
    lse = row_lse(z)
    logp = z.gather(-1, t[:, None]).squeeze(-1) - lse
    return logp.to(logits.device), lse.to(logits.device)


@_token_logprobs.register_fake
def _token_logprobs_fake(logits, tokens, temperature=1.0):
    _check_logprobs("token_logprobs", logits, tokens)
    _check_temperature("token_logprobs", temperature)
    n = logits.shape[0]
    return logits.new_empty(n, dtype=torch.float32), logits.new_empty(n, dtype=torch.float32)


@torch.library.custom_op("rlk_model::token_logprobs_bwd", mutates_args=())
def _token_logprobs_bwd(dlogp: torch.Tensor, dlse: torch.Tensor, logits: torch.Tensor, tokens: torch.Tensor,
                        lse: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    _check_logprobs("token_logprobs_bwd", logits, tokens)
    _check_temperature("token_logprobs_bwd", temperature)
    n = logits.shape[0]
    for name, t in (("dlogp", dlogp), ("dlse", dlse), ("lse", lse)):
        if t.dtype != torch.float32 or list(t.shape) != [n] or t.device != logits.device:
            raise ValueError(f"rlk_model::token_logprobs_bwd: {name} must be float32 [{n}] on {logits.device}, got "
                             f"{t.dtype} {list(t.shape)} on {t.device}")
    # with z = logits / T: d logp / d z = onehot(token) - p and d lse / d z = p, p = exp(z - lse); one product
    # per element, the token's element gets dlogp added (one add), then 1/T: no reduction anywhere
    dz = (dlse - dlogp)[:, None] * torch.exp(tempered(logits.float(), temperature) - lse[:, None])
    dz.scatter_add_(-1, tokens.long()[:, None], dlogp[:, None])
    return tempered(dz, temperature).to(logits.dtype)


@_token_logprobs_bwd.register_fake
def _token_logprobs_bwd_fake(dlogp, dlse, logits, tokens, lse, temperature=1.0):
    _check_logprobs("token_logprobs_bwd", logits, tokens)
    return logits.new_empty(logits.shape)


def _setup_logprobs(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1], output[1])
    ctx.temperature = inputs[2]


def _backward_logprobs(ctx, dlogp, dlse):
    logits, tokens, lse = ctx.saved_tensors
    dlogp = torch.zeros_like(lse) if dlogp is None else dlogp.contiguous()
    dlse = torch.zeros_like(lse) if dlse is None else dlse.contiguous()
    return torch.ops.rlk_model.token_logprobs_bwd(dlogp, dlse, logits, tokens, lse, ctx.temperature), None, None


_token_logprobs.register_autograd(_backward_logprobs, setup_context=_setup_logprobs)


# ------------------------------------------------------------------ the embedding
# rlk_model::embedding(weight [V, D], ids [...], padding_idx) -> [..., D]       a gather (exact)
# rlk_model::embedding_bwd(dout [..., D], ids, num_weights, padding_idx) -> dweight [V, D] (dout's dtype)
#
# The backward sums each id's rows of dout in fp32, in ascending position order, and rounds once (the row of
# padding_idx, if not -1, stays 0, as nn.Embedding's). As an op, eager and torch.compile run the same
# kernel: Inductor lowered nn.Embedding's backward to a scatter-add of its own, whose sums of repeated ids
# differed from eager's (tests/test_hf_model.py). The sum is index_put_ with accumulate=True under
# torch.use_deterministic_algorithms (set for that call alone): on CPU a serial loop in position order
# (without the mode ATen adds in parallel, atomically), on CUDA the sorted, segment-ordered kernel.


def _check_embedding(op: str, weight: torch.Tensor, ids: torch.Tensor, padding_idx: int) -> None:
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"rlk_model::{op}: weight must be a floating tensor [num_embeddings, dim], got "
                         f"{weight.dtype} {list(weight.shape)}")
    if ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rlk_model::{op}: ids must be int64 or int32 token ids, got {ids.dtype}")
    if ids.device != weight.device:
        raise ValueError(f"rlk_model::{op}: ids must be on weight's device {weight.device}, got {ids.device}")
    if not -1 <= padding_idx < weight.shape[0]:
        raise ValueError(f"rlk_model::{op}: padding_idx must be -1 (none) or in [0, {weight.shape[0]}), got "
                         f"{padding_idx}")


def _check_ids(op: str, ids: torch.Tensor, num: int) -> None:
    V.token_ids_in_range(f"rlk_model::{op}", "ids", ids, num, "the embedding's rows")


@torch.library.custom_op("rlk_model::embedding", mutates_args=())
def _embedding(weight: torch.Tensor, ids: torch.Tensor, padding_idx: int) -> torch.Tensor:
    no_forward_ad("rlk_model::embedding")
    _check_embedding("embedding", weight, ids, padding_idx)
    _check_ids("embedding", ids, weight.shape[0])
    return weight.index_select(0, ids.reshape(-1)).reshape(*ids.shape, weight.shape[1])


@_embedding.register_fake
def _embedding_fake(weight, ids, padding_idx):
    _check_embedding("embedding", weight, ids, padding_idx)
    return weight.new_empty(*ids.shape, weight.shape[1])


@torch.library.custom_op("rlk_model::embedding_bwd", mutates_args=())
def _embedding_bwd(dout: torch.Tensor, ids: torch.Tensor, num_weights: int, padding_idx: int) -> torch.Tensor:
    if list(dout.shape[:-1]) != list(ids.shape) or dout.dim() < 1 or not dout.is_floating_point():
        raise ValueError(f"rlk_model::embedding_bwd: dout must be a floating tensor [*ids.shape, dim] = "
                         f"[{', '.join(map(str, ids.shape))}, dim], got {dout.dtype} {list(dout.shape)}")
    if ids.dtype not in (torch.int32, torch.int64) or ids.device != dout.device:
        raise ValueError(f"rlk_model::embedding_bwd: ids must be int64 or int32 token ids on dout's device "
                         f"{dout.device}, got {ids.dtype} on {ids.device}")
    if num_weights < 1 or not -1 <= padding_idx < num_weights:
        raise ValueError(f"rlk_model::embedding_bwd: num_weights must be >= 1 and padding_idx -1 (none) or in "
                         f"[0, num_weights), got num_weights {num_weights}, padding_idx {padding_idx}")
    rows = dout.reshape(-1, dout.shape[-1]).float()
    # fp32 sums for the ids present only (the whole table in fp32 cost 3x nn.Embedding's backward at vocab 151936)
    present, slot = torch.unique(ids.reshape(-1).long(), sorted=True, return_inverse=True)
    acc = torch.zeros(present.shape[0], dout.shape[-1], dtype=torch.float32, device=dout.device)
    mode, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        acc.index_put_((slot,), rows, accumulate=True)
    finally:
        torch.use_deterministic_algorithms(mode, warn_only=warn)
    out = torch.zeros(num_weights, dout.shape[-1], dtype=dout.dtype, device=dout.device)
    out[present] = acc.to(dout.dtype)
    if padding_idx >= 0:
        out[padding_idx] = 0
    return out


@_embedding_bwd.register_fake
def _embedding_bwd_fake(dout, ids, num_weights, padding_idx):
    return dout.new_empty(num_weights, dout.shape[-1])


def _setup_embedding(ctx, inputs, output):
    weight, ids, padding_idx = inputs
    ctx.save_for_backward(ids)
    ctx.num_weights, ctx.padding_idx = weight.shape[0], padding_idx


def _backward_embedding(ctx, dout):
    (ids,) = ctx.saved_tensors
    return torch.ops.rlk_model.embedding_bwd(dout.contiguous(), ids, ctx.num_weights, ctx.padding_idx), None, None


_embedding.register_autograd(_backward_embedding, setup_context=_setup_embedding)
