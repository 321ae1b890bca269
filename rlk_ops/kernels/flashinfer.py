"""FlashInfer backend: rlk::paged_attention with an explicit split-KV policy, and the
diagnostic rlk::paged_attention_auto lane.

Every policy runs FlashInfer's tensor-core decode (``BatchDecodeWithPagedKVCacheWrapper``
with ``use_tensor_cores=True``, backend pinned to "fa2"; Sq > 1 uses its
``q_len_per_req`` causal mode, bottom-right aligned like the contract):

* ``disabled``  -> ``disable_split_kv=True``: one pass over each row's keys;
* ``fixed:N``   -> ``fixed_split_size=N // page_size`` (FlashInfer counts pages; N must be
                   a multiple of page_size): N-token chunks from position 0, merged in a
                   fixed order, so batch-invariant, but not the single-pass bits training
                   computes (not train == rollout);
* ``auto``      -> FlashInfer's own split, chosen from the whole batch: not
                   batch-invariant (only via rlk::paged_attention_auto, outside strict mode);
* ``canonical:C`` is not implemented here.

Facts measured on the H200 (DESIGN.md; results/h200/kernels.json): ``run(...,
return_lse=True)`` returns LSE in log2 units, so it is multiplied by ln 2 here;
``fixed_split_size`` is only accepted with tensor cores; each kernel JIT-builds on
first use (14-25 s). Planning reads seq_lens on the host (one device-to-host copy per
call, like the op layer's value checks).

Provenance: the dispatch point records which backend ran; ``plan_log()`` records, per
call, the policy and the plan FlashInfer actually made (did it split, chunk size in
tokens, work items), read back from the wrapper after ``plan``.
"""
from __future__ import annotations

import math
import threading

import torch

from rlk_ops.kernels.dispatch import BackendUnavailable
from rlk_ops.meta.contract import SplitKVPolicy

_OPS = ("paged_attention", "paged_attention_auto")
WORKSPACE_BYTES = 128 << 20
LN2 = math.log(2.0)
_wrappers: dict[str, object] = {}
_lock = threading.Lock()
_run_lock = threading.Lock()


def check_available(op: str) -> None:
    if op not in _OPS:
        raise BackendUnavailable(f"the flashinfer backend has no kernel for rlk::{op} (it has: {', '.join(_OPS)})")
    if not torch.cuda.is_available():
        raise BackendUnavailable("torch.cuda is not available (no CUDA GPU, or a CPU-only torch build)")
    try:
        import flashinfer  # noqa: F401
    except Exception as e:  # ImportError, or a CUDA/JIT set-up error raised at import
        raise BackendUnavailable(f"flashinfer cannot be imported: {type(e).__name__}: {e}") from e


def flashinfer_split_args(split_kv: str | SplitKVPolicy, page_size: int) -> dict:
    """FlashInfer plan() arguments for a split-KV policy (pure; no GPU needed)."""
    policy = SplitKVPolicy.parse(split_kv)
    if policy.kind == "disabled":
        return {"disable_split_kv": True, "fixed_split_size": None}
    if policy.kind == "fixed":
        if policy.size % page_size:
            raise ValueError(f"rlk::paged_attention (flashinfer): split_kv 'fixed:{policy.size}' must be a multiple "
                             f"of the cache's page_size {page_size} (FlashInfer splits in whole pages)")
        return {"disable_split_kv": False, "fixed_split_size": policy.size // page_size}
    if policy.kind == "auto":
        return {"disable_split_kv": False, "fixed_split_size": None}
    raise ValueError(f"rlk::paged_attention (flashinfer): split_kv {str(policy)!r} is not implemented by the "
                     f"flashinfer backend (supported: disabled, fixed:N)")


class PlanLog:
    """Distinct (policy, plan) records with call counts; cheap enough to stay on."""

    def __init__(self) -> None:
        self._records: dict[tuple, dict] = {}

    def add(self, rec: dict) -> None:
        key = tuple(sorted(rec.items()))
        entry = self._records.get(key)
        if entry is None:
            entry = self._records[key] = {**rec, "calls": 0}
        entry["calls"] += 1

    def records(self) -> list[dict]:
        return [dict(r) for r in self._records.values()]

    def clear(self) -> None:
        self._records.clear()


_log = PlanLog()
last_plan: dict | None = None


def plan_log() -> PlanLog:
    return _log


def _wrapper(device: torch.device):
    import flashinfer

    key = str(device)
    w = _wrappers.get(key)
    if w is None:
        with _lock:
            w = _wrappers.get(key)
            if w is not None:   # another thread made it while this one waited
                return w
            workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True, backend="fa2")
            _wrappers[key] = w
    return w


def _csr(page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int):
    """page_table rows -> FlashInfer's (indptr, indices, last_page_len); reads only used pages."""
    lens = seq_lens.to("cpu", torch.int64)
    n_pages = (lens + page_size - 1) // page_size
    indptr = torch.zeros(lens.shape[0] + 1, dtype=torch.int32)
    indptr[1:] = n_pages.cumsum(0)
    used = torch.arange(page_table.shape[1], device=page_table.device)[None, :] < n_pages.to(page_table.device)[:, None]
    indices = page_table[used].to(torch.int32).contiguous()
    last = torch.where(n_pages > 0, lens - (n_pages - 1) * page_size, 0).to(torch.int32)
    return indptr, indices, last


def _read_plan(w, policy: str, args: dict, batch: int, q_len: int, page_size: int) -> dict:
    rec = {"policy": policy, "flashinfer_backend": str(getattr(w, "resolved_backend", "?")), "use_tensor_cores": True,
           "disable_split_kv": bool(args["disable_split_kv"]), "fixed_split_size_pages": args["fixed_split_size"],
           "page_size": page_size, "batch": batch, "q_len": q_len}
    try:  # FlashInfer's PrefillPlanInfo vector (scheduler.cuh): [0] padded batch, [3] cta_tile_q,
        # [9] offset of kv_chunk_size in the pinned int workspace, [14] split_kv
        info = [int(v) for v in w._plan_info]
        split = bool(info[14])
        rec.update(split_kv=split, work_items=info[0], cta_tile_q=info[3])
        if split:
            raw = w._pin_memory_int_workspace_buffer[info[9]:info[9] + 4].tolist()  # int32, 1-byte aligned
            rec["kv_chunk_tokens"] = int.from_bytes(bytes(raw), "little", signed=True)
        else:
            rec["kv_chunk_tokens"] = None
    except Exception as e:  # a FlashInfer version with another layout: say so, do not guess
        rec["plan_info_error"] = f"{type(e).__name__}: {e}"
    return rec


def _run(q, k_cache, v_cache, page_table, seq_lens, softmax_scale, policy: str):
    global last_plan
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"rlk::paged_attention (flashinfer): q must be bfloat16 or float16, got {q.dtype}")
    b, sq, hq, d = q.shape
    _, ps, hkv, _ = k_cache.shape
    args = flashinfer_split_args(policy, ps)
    if b == 0 or sq == 0:
        return q.new_empty(q.shape), torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    w = _wrapper(q.device)
    indptr, indices, last = _csr(page_table, seq_lens, ps)
    # one wrapper per device holds one plan: plan and run under one lock, or a thread could run with
    # another thread's plan (its lengths and pages; a session 34 audit)
    with _run_lock:
        w.plan(indptr, indices, last, hq, hkv, d, ps, q_data_type=q.dtype, kv_data_type=k_cache.dtype,
               sm_scale=float(softmax_scale), q_len_per_req=sq, **args)
        last_plan = _read_plan(w, policy, args, b, sq, ps)
        _log.add(last_plan)
        out, lse2 = w.run(q.reshape(b * sq, hq, d).contiguous(), (k_cache, v_cache), return_lse=True)
    lse = (lse2.view(b, sq, hq).permute(0, 2, 1) * LN2).contiguous()  # log2 -> natural log
    return out.view(b, sq, hq, d), lse


def paged_attention(q, k_cache, v_cache, page_table, seq_lens, softmax_scale, split_kv="disabled"):
    policy = SplitKVPolicy.parse(split_kv)
    if policy.kind == "auto":  # the op layer refuses it too; this lane is paged_attention_auto
        raise ValueError("rlk::paged_attention: split_kv 'auto' is not batch-invariant; "
                         "use rlk::paged_attention_auto outside strict mode")
    return _run(q, k_cache, v_cache, page_table, seq_lens, softmax_scale, str(policy))


def paged_attention_auto(q, k_cache, v_cache, page_table, seq_lens, softmax_scale):
    return _run(q, k_cache, v_cache, page_table, seq_lens, softmax_scale, "auto")
