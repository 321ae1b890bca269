"""Input validation shared by the op modules.

Every error names the op, the argument, the expected and the actual value. Two kinds:

* metadata checks (shapes, dtypes, devices, scalar arguments) read no tensor data;
  they run in the op body and in its fake, so they also fire under torch.compile;
* value checks (page ids, slots, cu_seqlens, positions, seq_lens) read tensor data.
  They run inside the op body, before any work or write. On CPU they always run; on
  CUDA they cost a device-to-host copy of small int tensors and run unless
  ``RLK_VALUE_CHECKS=0`` or inside ``rlk_ops.value_checks(False)`` (see README, "Where
  checks run"). That copy is a sync, which CUDA graph capture forbids: a value-checked
  op called on CUDA while its stream captures raises ``ValueChecksInCapture`` instead
  of skipping its checks or failing inside the capture with CUDA's own error.
"""
from __future__ import annotations

import math
import operator
import os
import struct

import torch

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
VALUE_CHECKS = os.environ.get("RLK_VALUE_CHECKS", "1").lower() not in ("0", "false", "no", "off")


class RlkInputError(ValueError):
    """Bad input to an rlk op. The message names the argument, expected and actual value."""


class ValueChecksInCapture(RuntimeError):
    """A value-checked rlk op was called on CUDA during CUDA graph capture with value checks on."""


def value_checks(enabled: bool = True):
    """Turn the CUDA value checks on or off inside the block (process-wide, like
    ``RLK_VALUE_CHECKS``; CPU inputs are always checked). Off is for callers that build
    their own page tables, slots and cu_seqlens, e.g. to capture decode in a CUDA graph.
    ``enabled`` is a bool (``value_checks(None)`` turned the checks off; a session 38 audit); the
    block is entered and left eagerly inside a torch.compile'd function, as ``strict()`` is."""
    if not isinstance(enabled, bool):
        raise TypeError(f"value_checks: enabled must be a bool, got {type(enabled).__name__} {enabled!r}")
    from rlk_ops.kernels.dispatch import _Scoped   # (dispatch imports nothing from here)

    return _Scoped.module_global(__name__, "VALUE_CHECKS", enabled, "rlk_ops.value_checks()")


def positive_ints(owner: str, **values) -> None:
    """Sizes and counts outside the ops (configs, the demo's options): each an int > 0, or a
    ValueError "``owner`` ``name`` must be a positive int, got ``value``"."""
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{owner} {name} must be a positive int, got {value!r}")


def fail(op: str, msg: str) -> None:
    raise RlkInputError(f"rlk::{op}: {msg}")


# ------------------------------------------------------------------ public arguments
# The public functions check their Python arguments before the op call: the op schema's
# own errors ("Expected a value of type 'int' for argument 'rotary_dim'") name neither the
# rlk argument's meaning nor the value, and float("a") names nothing at all.
_INT64 = (-(2 ** 63), 2 ** 63)


def tensors(op: str, optional: tuple[str, ...] = (), **values) -> None:
    """Each value a torch.Tensor (those named in ``optional`` may also be None)."""
    for name, value in values.items():
        if value is None and name in optional:
            continue
        if not isinstance(value, torch.Tensor):
            kind = "a torch.Tensor or None" if name in optional else "a torch.Tensor"
            fail(op, f"{name} must be {kind}, got {type(value).__name__} {short_repr(value)}")
        if value.layout != torch.strided:  # else the dispatcher's "Could not run 'rlk::op' ... 'SparseCPU'"
            fail(op, f"{name} must be a dense (strided) tensor, got layout {value.layout}")


def no_gradient_inputs(op: str, reason: str | None = None, **values) -> None:
    """An op that records no gradient refuses inputs that require grad under grad mode, at the call.
    The rollout-side ops without a derivative (public function; traced by Dynamo too), so eager and
    compiled calls agree: their autograd kernel raises only once a backward reaches it, and under
    torch.compile AOTAutograd traces that backward at the first call (a session 39 review); and the
    append, whose write would record a gradient into the cache. ``reason``: why (default: no derivative)."""
    if torch.is_grad_enabled():
        why = reason or f"rlk::{op} has no derivative (a rollout-side op)"
        for name, t in values.items():
            if isinstance(t, torch.Tensor) and t.requires_grad:
                fail(op, f"{name} must not require grad: {why}; pass {name}.detach(), or call it under "
                         f"torch.no_grad() or torch.inference_mode()")


def float_arg(op: str, name: str, value, what: str = "a float") -> float:
    """A number as a float (int, float, numpy scalar, 0-d tensor or array; not a bool, a string or
    None); its range is the op's check. Under torch.compile a numpy scalar arrives as an array,
    hence ``float()`` rather than an isinstance test on numbers.Real. ``what``: the expectation the
    error names."""
    if isinstance(value, (torch.SymFloat, torch.SymInt)):
        return value
    if value is None or isinstance(value, (bool, str, bytes)):  # float(True) and float("0.5") would convert
        fail(op, f"{name} must be {what}, got {type(value).__name__} {short_repr(value)}")
    try:
        return float(value)
    except OverflowError:  # an int past float's range
        fail(op, f"{name} must be {what}, got {type(value).__name__} {short_repr(value)}, too large for a float")
    except (TypeError, ValueError):
        fail(op, f"{name} must be {what}, got {type(value).__name__} {short_repr(value)}")
    except RuntimeError:
        if not _meta(value):   # a CUDA error reading a tensor is its own problem
            raise
        fail(op, f"{name} must be {what}, got a meta Tensor (it has no value)")


def int_arg(op: str, name: str, value) -> int:
    """An integer (int, numpy integer; not bool) that fits in int64, as an int."""
    if isinstance(value, torch.SymInt):
        return value
    try:
        if isinstance(value, bool):
            raise TypeError
        # a plain int as is: under Dynamo a symbolic int is an int, and operator.index on it
        # would specialize the graph on its value (a recompile per value: max_seqlen)
        i = value if type(value) is int else operator.index(value)
    except TypeError:
        fail(op, f"{name} must be an int, got {type(value).__name__} {short_repr(value)}")
    except RuntimeError:
        if not _meta(value):
            raise
        fail(op, f"{name} must be an int, got a meta Tensor (it has no value)")
    if not _INT64[0] <= i < _INT64[1]:
        fail(op, f"{name} must fit in int64, got {short_repr(i)}")
    return i


def _meta(value) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == "meta"


def bool_arg(op: str, name: str, value) -> bool:
    """A bool, or a value equal to 0 or 1 that converts to one: an int, a numpy scalar, a 0-d
    tensor or array (not a string, None, or a sequence, which ``bool()`` would take)."""
    if isinstance(value, bool):
        return value
    if value is None or isinstance(value, (str, bytes, list, tuple, dict)):
        fail(op, f"{name} must be a bool, got {type(value).__name__} {short_repr(value)}")
    try:
        b = bool(value)
        if b == value:  # 2 (or tensor(2)) converts to True but is not a bool
            return b
    except (TypeError, ValueError, RuntimeError):
        pass
    fail(op, f"{name} must be a bool, got {type(value).__name__} {short_repr(value)}")


def finite(x) -> bool:
    """A number that is finite as a float (an int past float's range: False, where math.isfinite and
    float() raise OverflowError)."""
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def short_repr(value) -> str:
    """repr(value) for an error message: at most 60 characters; an int past Python's 4300-digit
    print limit as a power of two (~2**N)."""
    try:
        text = repr(value)
    except ValueError:   # an int past 4300 digits, which Python refuses to print
        if not isinstance(value, int):
            raise
        text = f"{'-' if value < 0 else ''}~2**{value.bit_length() - 1}"
    return text if len(text) <= 60 else text[:57] + "..."


def shape_str(t: torch.Tensor) -> str:
    return str(list(t.shape))


def ndim(op: str, name: str, t: torch.Tensor, n: int, layout: str) -> None:
    if t.dim() != n:
        fail(op, f"{name} must be {n}-D {layout}, got shape {shape_str(t)}")


def float_dtype(op: str, name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        fail(op, f"{name} must be bfloat16, float16, float32 or float64, got {t.dtype}")


def int_dtype(op: str, name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    if t.dtype != dtype:
        fail(op, f"{name} must be {dtype}, got {t.dtype}")


def same_dtype(op: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        fail(op, f"{name} must have the dtype of {ref_name} ({ref.dtype}), got {t.dtype}")


def same_device(op: str, tensors: dict[str, torch.Tensor | None]) -> None:
    items = [(k, v) for k, v in tensors.items() if v is not None]
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            fail(op, f"{name} is on {t.device} but {first_name} is on {first.device}; all inputs must share a device")


def dim_eq(op: str, what: str, actual, expected) -> None:
    if actual != expected:
        fail(op, f"{what} must be {expected}, got {actual}")


def first_bad(mask: torch.Tensor) -> tuple[int, ...]:
    """Index of the first True element of ``mask`` (row-major)."""
    idx = mask.nonzero()[0]
    return tuple(int(i) for i in idx)


def fmt_index(name: str, idx: tuple[int, ...]) -> str:
    return f"{name}[{', '.join(str(i) for i in idx)}]"


def value_checks_enabled(t: torch.Tensor, op: str = "") -> bool:
    """Whether ``op`` checks the values of ``t``: always on CPU; on CUDA while VALUE_CHECKS,
    and then never during graph capture (raises ValueChecksInCapture: the check's sync
    cannot be captured, and skipping it silently would drop a promised check)."""
    if t.device.type == "cpu":
        return True
    if not VALUE_CHECKS:
        return False
    if t.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        # an op's name (paged_kv_append) is prefixed rlk::, a caller's own (TinyQwen3.forward_paged) is not
        where = f"rlk::{op}" if op.isidentifier() else (op or "rlk op")
        raise ValueChecksInCapture(
            f"{where}: value checks read its index tensors on the host (one sync), which CUDA graph "
            "capture forbids; validate page tables, slots and cu_seqlens before capturing and capture under "
            "rlk_ops.value_checks(False) (or set RLK_VALUE_CHECKS=0)")
    return True


def token_ids_in_range(where: str, name: str, ids: torch.Tensor, num: int, what: str) -> None:
    """Every value of the integer tensor ``ids`` in [0, ``num``) (``what`` names the range), checked as the
    ops check their index values (``value_checks_enabled``); else RlkInputError naming the first bad one."""
    if not ids.numel() or not value_checks_enabled(ids, where):
        return
    bad = (ids < 0) | (ids >= num)
    if on_device(ids) and all_clear(bad):
        return
    if bool(bad.any()):
        i = first_bad(bad.cpu())
        raise RlkInputError(f"{where}: {fmt_index(name, i)} = {int(ids[i])} is not a token id; token ids must be in "
                            f"[0, {num}) ({what})")


def overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors (on one device) may share a byte: their address spans [first, last
    element] intersect (exact for contiguous tensors, conservative for strided ones). Addresses,
    not storage objects: two storages can wrap one buffer (e.g. torch.from_numpy of two
    overlapping numpy views), and two inputs can be views of one buffer."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def span(t: torch.Tensor) -> tuple[int, int]:
    """The addresses [first element, one past the last element's last byte] of ``t``."""
    p = t.data_ptr()
    if t.is_contiguous():   # the common case, without the Python sum over dims (the op layer's cost)
        return p, p + t.numel() * t.element_size()
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if st > 0)
    return p, p + (last + 1) * t.element_size()


def on_device(t: torch.Tensor) -> bool:
    """Tensor data lives off the host: value checks then take the one-sync fast path."""
    return t.device.type != "cpu"


def all_clear(*bad: torch.Tensor) -> bool:
    """True when no element of any device-side violation mask is set, at the cost of a
    single device-to-host sync. The detailed (host-side) check that builds the error
    message runs only when this returns False."""
    return not bool(torch.stack([b.any() for b in bad]).any())


def head_dim(op: str, name: str, t: torch.Tensor) -> None:
    if t.shape[-1] < 1:
        fail(op, f"{name} must have head_dim >= 1 (its last dim), got shape {shape_str(t)}")


def softmax_scale(op: str, q: torch.Tensor, value) -> float:
    """A public function's ``softmax_scale`` as the op takes it: None is q's head_dim ** -0.5;
    anything else must convert to a float (its finiteness is the op's check)."""
    if value is None:
        if q.dim() == 0:
            fail(op, "q must have a head_dim (its last dim), got a 0-d tensor")
        head_dim(op, "q", q)
        return q.shape[-1] ** -0.5
    return float_arg(op, "softmax_scale", value, "a float or None")


def as_float32(x: float) -> float:
    """``x`` rounded to float32 (to nearest, as the kernels' float32 arguments take it); +-inf past its range."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def scale_value(op: str, scale, dtype: torch.dtype) -> None:
    """softmax_scale as the kernels use it: finite, and but for float64 inputs finite in float32 and
    not flushed to 0 there (1e39 made every score inf and the output NaN, without an error). A scale
    finite in float32 can still overflow a score (|q . k| * scale past 3.4e38: 5e37 with |q . k| ~ 12):
    then, as in SDPA, the row is NaN; the op cannot see it without the scores."""
    if not math.isfinite(scale):
        fail(op, f"softmax_scale must be finite, got {scale}")
    if dtype != torch.float64 and isinstance(scale, float):
        f32 = as_float32(scale)
        if not math.isfinite(f32) or (f32 == 0) != (scale == 0):
            fail(op, f"softmax_scale = {scale} is {'inf' if f32 else '0'} in float32, the dtype the kernels scale "
                     f"{dtype} inputs in; it must be a finite float32 (0 only if it is 0)")


def rms_eps(op: str, eps, dtype: torch.dtype) -> None:
    """RMSNorm's eps: finite, and a normal number of the accumulation dtype (float64 for float64
    inputs, else float32): 0 makes an all-zero row 0 / 0 = NaN, and so does an eps that rounds to 0
    (1e-300 in float32)."""
    if not (eps > 0 and math.isfinite(eps)):
        fail(op, f"eps must be a finite number > 0, got {eps}" + (" (with 0 an all-zero row normalises to NaN)"
                                                                  if eps == 0 else ""))
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    if isinstance(eps, float) and eps < torch.finfo(acc).tiny:
        fail(op, f"eps must be at least {torch.finfo(acc).tiny}, the smallest normal {acc} (the accumulation "
                 f"dtype of {dtype} inputs), got {eps}")


def check_positions(op: str, x: torch.Tensor, positions: torch.Tensor, x_layout: str) -> None:
    """positions: int64 with x's leading shape (all dims but the last two), >= 0."""
    if positions.dtype != torch.int64:
        fail(op, f"positions must be torch.int64, got {positions.dtype}")
    lead = tuple(x.shape[:-2])
    if tuple(positions.shape) != lead:
        fail(op, f"positions must have x's leading shape {list(lead)} (x is {x_layout} {shape_str(x)}), "
                 f"got {shape_str(positions)}")


def check_positions_values(op: str, positions: torch.Tensor, max_position: int | None = None) -> None:
    if not positions.numel() or not value_checks_enabled(positions, op):
        return
    if on_device(positions):
        bad = positions < 0 if max_position is None else (positions < 0) | (positions > max_position)
        if all_clear(bad):
            return
        positions = positions.cpu()
    neg = positions < 0
    if bool(neg.any()):
        i = first_bad(neg)
        fail(op, f"{fmt_index('positions', i)} = {int(positions[i])} is negative; positions must be >= 0")
    if max_position is not None and bool((positions > max_position).any()):
        i = first_bad(positions > max_position)
        fail(op, f"{fmt_index('positions', i)} = {int(positions[i])} exceeds the largest "
                 f"supported position {max_position}")


def check_cu_seqlens(op: str, name: str, cu: torch.Tensor, total: int, max_seqlen: int, max_name: str) -> None:
    """cu_seqlens: int32 [B+1], starts at 0, non-decreasing, ends at the token count."""
    if cu.dtype != torch.int32:
        fail(op, f"{name} must be torch.int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.shape[0] < 2:
        fail(op, f"{name} must be 1-D [batch + 1] with at least 2 entries, got shape {shape_str(cu)}")
    if not value_checks_enabled(cu, op):
        return
    vals = cu.cpu().long()  # differences in int64: in int32 INT32_MAX -> INT32_MIN wraps to +1
    if int(vals[0]) != 0:
        fail(op, f"{name}[0] must be 0, got {int(vals[0])}")
    lens = vals[1:] - vals[:-1]
    if bool((lens < 0).any()):
        i = first_bad(lens < 0)[0]
        fail(op, f"{name} must be non-decreasing, but {name}[{i + 1}] = {int(vals[i + 1])} < "
                 f"{name}[{i}] = {int(vals[i])}")
    if int(vals[-1]) != total:
        fail(op, f"{name}[-1] must equal the packed token count {total}, got {int(vals[-1])}")
    longest = int(lens.max())
    if longest > max_seqlen:
        fail(op, f"{max_name} = {max_seqlen} is smaller than the longest sequence in {name} ({longest})")
