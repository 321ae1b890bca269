"""rlk::paged_kv_append (in place) and rlk::paged_kv_gather: the paged KV cache.

    k_cache, v_cache  [num_pages, page_size, H_kv, D]   (FlashInfer NHD), contiguous
    k, v              [T, H_kv, D]                      rows to write, cache dtype
    slot_mapping      [T] int64: slot = page * page_size + offset; -1 skips the row
    page_table        [B, max_pages] int32: sequence b's logical page j -> physical page
    seq_lens          [B] int32: KV length of each sequence (new tokens included)

append writes row t to slot slot_mapping[t]. It validates everything first, so a
rejected append leaves the cache untouched. Given page_table and seq_lens (B rows,
T = B * Sq new tokens, as the block's forward_rollout passes them), it also checks
that row b * Sq + j (unless its slot is -1: skipped) goes where those put token
p = seq_lens[b] - Sq + j of sequence b:
slot page_table[b, p // page_size] * page_size + p % page_size (and, given positions
[B, Sq], that positions[b, j] == p). A slot in another sequence's page, or seq_lens
that leave the new tokens out, are refused before any write. gather returns the logical
``[B, max_pages * page_size, H_kv, D]`` view of each sequence, zero past seq_len.
Only the first ceil(seq_lens[b] / page_size) entries of page_table[b] are read or
validated; the rest of the row is padding and may hold anything.
"""
from __future__ import annotations

import functools
import math

import torch

from rlk_ops.kernels.dispatch import kernel_for
from rlk_ops.ops import _validate as V
from rlk_ops.ops._library import define, fake, impl


def paged_kv_append(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    slot_mapping: torch.Tensor, page_table: torch.Tensor | None = None,
                    seq_lens: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> None:
    """Write K/V rows into their slots, in place. With ``page_table`` and ``seq_lens`` (and
    ``positions``) the slots are checked against where those put the rows (module docstring)."""
    given = {n: t for n, t in (("page_table", page_table), ("seq_lens", seq_lens), ("positions", positions))
             if t is not None}
    V.tensors("paged_kv_append", k_cache=k_cache, v_cache=v_cache, k=k, v=v, slot_mapping=slot_mapping, **given)
    torch.ops.rlk.paged_kv_append(k_cache, v_cache, k, v, slot_mapping, page_table, seq_lens, positions)


def paged_kv_gather(k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                    seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logical per-sequence K and V, zero past seq_len."""
    V.tensors("paged_kv_gather", k_cache=k_cache, v_cache=v_cache, page_table=page_table, seq_lens=seq_lens)
    V.no_gradient_inputs("paged_kv_gather", k_cache=k_cache, v_cache=v_cache)
    return torch.ops.rlk.paged_kv_gather(k_cache, v_cache, page_table, seq_lens)


define("paged_kv_append")


@impl("paged_kv_append")
def _paged_kv_append(k_cache, v_cache, k, v, slot_mapping, page_table=None, seq_lens=None, positions=None):
    op = "paged_kv_append"
    _check_append(k_cache, v_cache, k, v, slot_mapping, page_table, seq_lens, positions)
    # overlapping memory (not visible to a fake, which has no data pointer); two halves of
    # one buffer, e.g. kv[0] and kv[1], are separate caches
    if V.overlap(k_cache, v_cache):
        V.fail(op, _SHARED_CACHE)
    for name, t in (("k", k), ("v", v)):  # rows read from memory the append writes: order-dependent
        for cname, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            if V.overlap(t, c):
                V.fail(op, f"{name} must not overlap {cname} in memory (its rows would be read while the "
                           f"append writes them); pass a copy, e.g. {name}.clone()")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):  # both, before either is written
        if c.is_inference() and not torch.is_inference_mode_enabled():
            V.fail(op, f"{name} is an inference tensor, which cannot be written in place outside "
                       f"torch.inference_mode(); create the cache outside inference mode or append inside it")
    # the write would record a gradient into the cache (or fail half-way on a view)
    V.no_gradient_inputs(op, "the append writes values into the cache and records no gradient", k=k, v=v)
    if V.value_checks_enabled(slot_mapping, op):
        _check_append_values(op, k_cache, slot_mapping, page_table, seq_lens, positions)
    with torch.no_grad():  # a data write: no autograd history on the cache, whatever the caller's mode
        kernel_for(op, k_cache.device, mutated=(0, 1))(k_cache, v_cache, k, v, slot_mapping)


@fake("paged_kv_append")
def _paged_kv_append_fake(k_cache, v_cache, k, v, slot_mapping, page_table=None, seq_lens=None, positions=None):
    _check_append(k_cache, v_cache, k, v, slot_mapping, page_table, seq_lens, positions)


define("paged_kv_gather")


@impl("paged_kv_gather")
def _paged_kv_gather(k_cache, v_cache, page_table, seq_lens):
    op = "paged_kv_gather"
    check_cache(op, k_cache, v_cache)
    check_page_table(op, k_cache, page_table, seq_lens)
    check_page_values(op, k_cache, page_table, seq_lens)
    k, v = kernel_for(op, k_cache.device)(k_cache, v_cache, page_table, seq_lens)
    # contiguous, as the fake says: the CPU kernel's rows took the cache's strides (an HND cache viewed as
    # NHD failed Inductor's stride assert; a session 38 audit)
    return k.contiguous(), v.contiguous()


@fake("paged_kv_gather")
def _paged_kv_gather_fake(k_cache, v_cache, page_table, seq_lens):
    op = "paged_kv_gather"
    check_cache(op, k_cache, v_cache)
    check_page_table(op, k_cache, page_table, seq_lens)
    _, ps, h, d = k_cache.shape
    shape = (page_table.shape[0], page_table.shape[1] * ps, h, d)
    return k_cache.new_empty(shape), v_cache.new_empty(shape)


# ------------------------------------------------------------------ validation
_SHARED_CACHE = ("k_cache and v_cache must not overlap in memory, got overlapping tensors "
                 "(V rows would overwrite K rows)")


def check_cache(op, k_cache, v_cache):
    V.ndim(op, "k_cache", k_cache, 4, "[num_pages, page_size, H_kv, D]")
    V.ndim(op, "v_cache", v_cache, 4, "[num_pages, page_size, H_kv, D]")
    if v_cache.shape != k_cache.shape:
        V.fail(op, f"v_cache must have k_cache's shape {V.shape_str(k_cache)}, got {V.shape_str(v_cache)}")
    V.float_dtype(op, "k_cache", k_cache)
    V.same_dtype(op, "v_cache", v_cache, "k_cache", k_cache)
    V.same_device(op, {"k_cache": k_cache, "v_cache": v_cache})
    if min(k_cache.shape) < 1:
        V.fail(op, f"k_cache must have num_pages, page_size, H_kv and D >= 1, got shape {V.shape_str(k_cache)}")


def _check_append(k_cache, v_cache, k, v, slot_mapping, page_table=None, seq_lens=None, positions=None):
    op = "paged_kv_append"
    check_cache(op, k_cache, v_cache)
    if k_cache is v_cache:
        V.fail(op, _SHARED_CACHE)
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not c.is_contiguous():
            V.fail(op, f"{name} must be contiguous (slots address it as [num_pages * page_size, H_kv, D])")
        if c.requires_grad:
            V.fail(op, f"{name} must not require grad (it is written in place), got requires_grad=True")
    _, _, h, d = k_cache.shape
    for name, t in (("k", k), ("v", v)):
        V.ndim(op, name, t, 3, "[T, H_kv, D]")
        if tuple(t.shape[1:]) != (h, d):
            V.fail(op, f"{name} must be [T, {h}, {d}] to match the cache's [H_kv, D], got {V.shape_str(t)}")
        V.same_dtype(op, name, t, "k_cache", k_cache)
    if v.shape[0] != k.shape[0]:
        V.fail(op, f"v must have k's token count {k.shape[0]}, got {v.shape[0]}")
    V.int_dtype(op, "slot_mapping", slot_mapping, torch.int64)
    V.ndim(op, "slot_mapping", slot_mapping, 1, "[T]")
    if slot_mapping.shape[0] != k.shape[0]:
        V.fail(op, f"slot_mapping must have one slot per row of k ({k.shape[0]}), got {slot_mapping.shape[0]}")
    V.same_device(op, {"k_cache": k_cache, "k": k, "v": v, "slot_mapping": slot_mapping})
    if (page_table is None) != (seq_lens is None):
        V.fail(op, "page_table and seq_lens go together (to check the slots against them), got "
                   f"page_table={'a tensor' if page_table is not None else None}, "
                   f"seq_lens={'a tensor' if seq_lens is not None else None}")
    if page_table is None:
        if positions is not None:
            V.fail(op, "positions are checked against page_table and seq_lens; pass them too")
        return
    check_page_table(op, k_cache, page_table, seq_lens)
    b, t = page_table.shape[0], slot_mapping.shape[0]
    if (t % b != 0) if b else t != 0:
        V.fail(op, f"slot_mapping must hold Sq rows for each of the {b} page_table rows (B * Sq), "
                   f"got {t} rows")
    if positions is not None:
        V.int_dtype(op, "positions", positions, torch.int64)
        if positions.numel() != t or positions.dim() not in (1, 2) or (positions.dim() == 2 and
                                                                       positions.shape[0] != b):
            V.fail(op, f"positions must be [B, Sq] = [{b}, {t // b if b else 0}] (or [{t}]), "
                       f"got {V.shape_str(positions)}")
        V.same_device(op, {"k_cache": k_cache, "positions": positions})


def _check_append_values(op, k_cache, slot_mapping, page_table, seq_lens, positions):
    """The slots in range and distinct; given page_table and seq_lens (and positions), the page
    values and the placement (``_check_placement``). On a device the decision comes first, in one
    sync (``_append_clear``); the host checks, which name the first offender, run only when some
    check is not clear."""
    if slot_mapping.shape[0] == 0:   # nothing to place; the page values are still checked (before session
        if page_table is not None:    # 41 a zero-row append took any seq_lens and page ids)
            check_page_values(op, k_cache, page_table, seq_lens, min_len=0)
        return
    num_pages, ps = k_cache.shape[0], k_cache.shape[1]
    n_slots = num_pages * ps
    if V.on_device(slot_mapping) and _append_clear(slot_mapping, n_slots, num_pages, ps, page_table, seq_lens,
                                                   positions):
        return
    _check_slots(op, slot_mapping, n_slots)
    if page_table is not None:
        _check_placement(op, k_cache, slot_mapping, page_table, seq_lens, positions)


# ------------------------------------------------------------- the device decision
@functools.lru_cache(maxsize=None)
def _triton_checks():
    """rlk_ops.kernels.triton.index_checks, or the reason it cannot run (a str)."""
    try:
        from rlk_ops.kernels.triton import _common, index_checks
    except ImportError as e:
        return f"triton cannot be imported: {e}"
    if _common.INTERPRET:
        return "TRITON_INTERPRET=1 (the interpreter takes CPU tensors only)"
    return index_checks


def device_check_route(device: torch.device) -> str:
    """How a value check on ``device`` decides whether every check is clear: ``"triton"`` (the
    kernels of kernels/triton/index_checks.py, CUDA) or ``"masks: <why>"`` (device-side torch ops,
    the same decisions in more launches). Under "triton" a single call past the kernels' scratch
    budget or grid limit is still decided by the masks; this answer does not see the call. CPU tensors
    take the host checks directly."""
    if torch.device(device).type != "cuda":
        return "masks: the Triton checks run on CUDA only"
    mod = _triton_checks()
    return "triton" if not isinstance(mod, str) else f"masks: {mod}"


def _fused(name, t, *args):
    """The Triton decision ``name`` of index_checks, or None where it does not run."""
    if t.device.type != "cuda" or isinstance(_triton_checks(), str):
        return None
    return getattr(_triton_checks(), name)(*args)


def _append_clear(slot_mapping, n_slots, num_pages, ps, page_table, seq_lens, positions) -> bool:
    clear = _fused("append_clear", slot_mapping, slot_mapping, n_slots, num_pages, ps, page_table, seq_lens,
                   positions)
    if clear is None:
        clear = V.all_clear(*_append_masks(slot_mapping, n_slots, num_pages, ps, page_table, seq_lens, positions))
    return clear


def _append_masks(slot_mapping, n_slots, num_pages, ps, page_table, seq_lens, positions) -> list:
    """Every check of ``_check_append_values`` as a device-side mask (any element set: not clear)."""
    s = slot_mapping
    ids = torch.where(s >= 0, s, -1 - torch.arange(s.numel(), device=s.device)).sort().values
    masks = [(s < -1) | (s >= n_slots), ids[1:] == ids[:-1]]
    if page_table is None:
        return masks
    sq = s.shape[0] // page_table.shape[0]
    p, slot = _token_slots(page_table, seq_lens, sq, ps)
    live = s != -1
    masks += _page_value_masks(page_table, seq_lens, num_pages, ps, sq)
    masks.append(live & (s != slot))
    if positions is not None:
        masks.append(live & (positions.reshape(-1) != p))
    fill = _cached_fill(page_table, seq_lens, num_pages, ps, sq)
    masks.append(live & (s % ps < fill[(s // ps).clamp(0, num_pages)]))
    masks.append(live & _held(slot, live, n_slots)[s.clamp(0, n_slots)])
    return masks


def _token_slots(table, lens, sq, ps):
    """Per row b * Sq + j: its token p = lens[b] - Sq + j, and the slot the table puts p in (the
    column clamped into the table: only the host path reads p // page_size unchecked)."""
    p = lens.to(torch.int64)[:, None] - sq + torch.arange(sq, device=table.device)
    col = (p // ps).clamp(0, table.shape[1] - 1)
    return p.reshape(-1), (table.to(torch.int64).gather(1, col) * ps + p % ps).reshape(-1)


def _check_placement(op, k_cache, slot_mapping, page_table, seq_lens, positions):
    """Row b * Sq + j is token p = seq_lens[b] - Sq + j of sequence b: its slot must be
    page_table[b, p // page_size] * page_size + p % page_size, and positions[b, j] == p; and it must
    not hold a token another row has cached (two rows whose tables share a page: ``_cached_fill``, and
    the tokens rows skip with -1: ``_held``). On the host; the device decision is ``_append_clear``."""
    b, t = page_table.shape[0], slot_mapping.shape[0]
    if b == 0 or t == 0:
        return
    sq = t // b
    num_pages, ps = k_cache.shape[0], k_cache.shape[1]
    # seq_lens in [Sq, capacity] and pages in range (named first), then the placement
    check_page_values(op, k_cache, page_table, seq_lens, min_len=sq)
    table, lens = page_table.cpu(), seq_lens.cpu()
    p, slot = _token_slots(table, lens, sq, ps)
    got = slot_mapping.cpu()
    live = got != -1
    bad = live & (got != slot)
    if bool(bad.any()):
        i = V.first_bad(bad)[0]
        r, pi = i // sq, int(p[i])
        V.fail(op, f"slot_mapping[{i}] = {int(got[i])} is not the slot of its token: row {i} is token {pi} of "
                   f"sequence {r} (seq_lens[{r}] = {int(lens[r])}, {sq} new tokens), whose slot is "
                   f"page_table[{r}, {pi // ps}] = {int(table[r, pi // ps])} * page_size {ps} + {pi % ps} = "
                   f"{int(slot[i])}")
    if positions is not None:
        pos = positions.reshape(-1).cpu()
        bad = live & (pos != p)
        if bool(bad.any()):
            i = V.first_bad(bad)[0]
            r = i // sq
            V.fail(op, f"positions[{r}, {i % sq}] = {int(pos[i])} is not its token's position {int(p[i])} "
                       f"(seq_lens[{r}] = {int(lens[r])} with {sq} new tokens)")
    # another row's cached token in the slot: two rows whose tables hold one page
    fill = _cached_fill(table, lens, num_pages, ps, sq)
    bad = live & (got % ps < fill[(got // ps).clamp(0, num_pages)])
    if bool(bad.any()):
        i = V.first_bad(bad)[0]
        page, off = int(got[i]) // ps, int(got[i]) % ps
        cached = lens.to(torch.int64) - sq
        for r2, j in (table == page).nonzero().tolist():
            if off < cached[r2] - j * ps:
                V.fail(op, f"slot_mapping[{i}] = {int(got[i])} (page {page}, offset {off}) holds token {j * ps + off} "
                           f"of sequence {r2}, already cached (page_table[{r2}, {j}] = {page}, seq_lens[{r2}] = "
                           f"{int(lens[r2])} with {sq} new tokens): the append would overwrite another "
                           f"sequence's K/V; two rows share page {page}")
    # or a token another row's -1 slot says is cached (the slot its table puts that token in)
    bad = live & _held(slot, live, num_pages * ps)[got.clamp(0, num_pages * ps)]
    if bool(bad.any()):
        i = V.first_bad(bad)[0]
        j = int(((slot == got[i]) & ~live).nonzero()[0])
        V.fail(op, f"slot_mapping[{i}] = {int(got[i])} is where sequence {j // sq} keeps its token {int(p[j])}, which "
                   f"its slot_mapping[{j}] = -1 says is cached: the append would overwrite another sequence's K/V")


def _held(slot, live, n_slots):
    """``[n_slots + 1]`` bool: the slots of the tokens rows skip with -1 (cached, by that meaning),
    where their tables put them; slots out of range count into the last entry."""
    ok = ~live & (slot >= 0) & (slot < n_slots)
    held = torch.zeros(n_slots + 1, dtype=torch.bool, device=slot.device)
    return held.index_fill_(0, torch.where(ok, slot, n_slots), True)


def _cached_fill(page_table, seq_lens, num_pages, ps, sq):
    """``[num_pages + 1]`` int64: per page, how many of its leading slots hold a token that some row
    had cached before this append (positions below seq_lens - Sq), the most over the rows whose
    tables hold the page; ids out of range count into the last entry. A row writes its own tokens at
    or past its cached length, so only another row sharing the page can make a slot's offset fall
    below this."""
    cached = (seq_lens.to(torch.int64) - sq).clamp_min(0)
    cols = torch.arange(page_table.shape[1], device=page_table.device).view(1, -1)
    count = (cached.view(-1, 1) - cols * ps).clamp(0, ps)
    ids = page_table.to(torch.int64)
    ids = torch.where((count > 0) & (ids >= 0) & (ids < num_pages), ids, num_pages)
    fill = torch.zeros(num_pages + 1, dtype=torch.int64, device=page_table.device)
    return fill.scatter_reduce(0, ids.reshape(-1), count.reshape(-1), "amax")


def _check_slots(op, slot_mapping, n_slots):
    """Slots in range and distinct, on the host (the device decision is ``_append_clear``)."""
    if slot_mapping.numel() == 0:
        return
    slots = slot_mapping.cpu()
    bad = (slots < -1) | (slots >= n_slots)
    if bool(bad.any()):
        i = V.first_bad(bad)[0]
        V.fail(op, f"slot_mapping[{i}] = {int(slots[i])} is out of range for {n_slots} slots "
                   f"(valid: 0..{n_slots - 1}, or -1 to skip)")
    ids = torch.where(slots >= 0, slots, -1 - torch.arange(slots.numel())).sort().values
    if bool((ids[1:] == ids[:-1]).any()):
        seen: dict[int, int] = {}
        for i, s in enumerate(slots.tolist()):
            if s >= 0 and s in seen:
                V.fail(op, f"slot_mapping[{i}] = {s} duplicates slot_mapping[{seen[s]}]; "
                           f"two rows would write the same slot")
            seen[s] = i


def check_page_table(op, k_cache, page_table, seq_lens):
    V.int_dtype(op, "page_table", page_table, torch.int32)
    V.ndim(op, "page_table", page_table, 2, "[batch, max_pages]")
    if page_table.shape[1] == 0:
        V.fail(op, f"page_table must have at least one page column, got shape {V.shape_str(page_table)}")
    V.int_dtype(op, "seq_lens", seq_lens, torch.int32)
    V.ndim(op, "seq_lens", seq_lens, 1, "[batch]")
    if seq_lens.shape[0] != page_table.shape[0]:
        V.fail(op, f"seq_lens must have one entry per page_table row ({page_table.shape[0]}), "
                   f"got {seq_lens.shape[0]}")
    V.same_device(op, {"k_cache": k_cache, "page_table": page_table, "seq_lens": seq_lens})


def check_page_values(op, k_cache, page_table, seq_lens, min_len=None):
    """seq_lens within [min_len, capacity]; used page ids in range and distinct per row."""
    if not V.value_checks_enabled(page_table, op) or page_table.shape[0] == 0:
        return
    num_pages, ps = k_cache.shape[0], k_cache.shape[1]
    if V.on_device(page_table) and _page_values_clear(page_table, seq_lens, num_pages, ps, min_len):
        return
    table = page_table.cpu()
    lens = seq_lens.cpu().to(torch.int64)
    capacity = table.shape[1] * ps
    bad = (lens < 0) | (lens > capacity) | (lens < (min_len if min_len is not None else 0))
    if bool(bad.any()):  # vectorised test first, then the message for the first offender
        b = V.first_bad(bad)[0]
        n = int(lens[b])
        if n < 0:
            V.fail(op, f"seq_lens[{b}] = {n} is negative")
        if n > capacity:
            V.fail(op, f"seq_lens[{b}] = {n} exceeds the page_table capacity {table.shape[1]} pages x "
                       f"page_size {ps} = {capacity}")
        V.fail(op, f"seq_lens[{b}] = {n} is shorter than the {min_len} new query tokens; "
                   f"seq_lens counts the cached tokens including the new ones")
    used = torch.arange(table.shape[1]).view(1, -1) < ((lens + ps - 1) // ps).view(-1, 1)
    bad = used & ((table < 0) | (table >= num_pages))
    if bool(bad.any()):
        b, j = V.first_bad(bad)
        kind = "negative" if int(table[b, j]) < 0 else "out of range"
        V.fail(op, f"page_table[{b}, {j}] = {int(table[b, j])} is {kind} for {num_pages} pages")
    # duplicates inside one sequence: sort used ids, unused entries get distinct negatives
    sentinel = -1 - torch.arange(table.shape[1], dtype=table.dtype).view(1, -1)
    ids = torch.where(used, table, sentinel).sort(dim=1).values
    dup_rows = (ids[:, 1:] == ids[:, :-1]).any(dim=1)
    if bool(dup_rows.any()):
        b = int(dup_rows.nonzero()[0])
        first: dict[int, int] = {}
        for j in range(math.ceil(int(lens[b]) / ps)):
            p = int(table[b, j])
            if p in first:
                V.fail(op, f"page_table[{b}, {j}] = {p} duplicates page_table[{b}, {first[p]}]; "
                           f"a sequence cannot hold the same page twice")
            first[p] = j


def _page_values_clear(page_table, seq_lens, num_pages, ps, min_len) -> bool:
    """Whether every check of check_page_values is clear, in one sync: the Triton kernels on CUDA
    (``device_check_route``), else the device-side masks."""
    clear = _fused("page_values_clear", page_table, page_table, seq_lens, num_pages, ps, min_len)
    if clear is None:
        clear = V.all_clear(*_page_value_masks(page_table, seq_lens, num_pages, ps, min_len))
    return clear


def _page_value_masks(page_table, seq_lens, num_pages, ps, min_len) -> list:
    lens = seq_lens.to(torch.int64)
    width = page_table.shape[1]
    bad_len = (lens < (min_len or 0)) | (lens > width * ps)
    cols = torch.arange(width, device=page_table.device).view(1, -1)
    used = cols < ((lens + ps - 1) // ps).view(-1, 1)
    bad_id = used & ((page_table < 0) | (page_table >= num_pages))
    ids = torch.where(used, page_table, -1 - cols.to(page_table.dtype)).sort(dim=1).values
    return [bad_len, bad_id, ids[:, 1:] == ids[:, :-1]]
