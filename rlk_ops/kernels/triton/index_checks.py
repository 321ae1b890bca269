"""The paged-KV index tensors' value checks on the GPU: one zeroed scratch buffer, at most two
Triton launches and one sync.

rlk_ops/ops/paged_kv.py states each check as device-side torch masks (``_append_masks``,
``_page_value_masks``): about 90 small ops for an append with page_table, seq_lens and positions,
whose launches, not their GPU time, made a decode step's append cost 1.4-2.7 ms on the H100 against
0.1-0.2 ms unchecked (results/h100/session32/append_checks.json). These kernels decide the same
thing, "every check clear", and nothing else: when a check is not clear the op's host path finds
the first offender and names it, so the messages do not change. The two formulations must agree on
every input, clear or not (tests/test_index_checks.py compares them on random and adversarial
cases, in the interpreter on CPU and on the GPU): a kernel that called a bad append clear would let
it corrupt the cache.

``_table_kernel``, one program per (sequence, block of page-table columns):
  * seq_lens[b] within [min_len, width * page_size];
  * the used entries (the first ceil(seq_lens[b] / page_size)) in [0, num_pages);
  * no page twice in one row: a bit per (row, page), set with ``atomic_or``; whichever entry sets
    an already-set bit is the duplicate, whatever the order the programs run in;
  * for the placement, each page's cached fill: the most leading slots of the page that any row
    holding it had cached before the append (``atomic_max``).
``_rows_kernel``, one program per block of rows (after the table kernel: it reads the fills):
  * slots in [-1, n_slots);
  * one ``atomic_add`` per row on a counter per slot: +1 for a row that writes its slot, +2**32 for
    a row that skips (-1) at the slot where its table puts its token (a cached token, by that
    meaning). A writing row that finds the counter non-zero duplicates a slot or overwrites a
    skipped row's token; a skipping row that finds a writer there is the same conflict seen from
    the other side. Two skipping rows may share a slot (padding), as the masks allow;
  * with the placement: each writing row's slot is where page_table puts its token, positions
    match, and the slot's offset is not below its page's cached fill.

Every decision is an integer comparison or an atomic whose result does not depend on the order the
programs run in. Each program also counts itself: the decision is read with the count, and a count
short of the programs launched raises instead of reading as clear. The scratch is 8 bytes per cache
slot, 4 per page and one bit per (row, page); past ``MAX_SCRATCH_BYTES``, or past 2**31 - 1
programs, the caller keeps the masks (the same decisions, more launches).
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from rlk_ops.kernels.triton import _common as C

MAX_SCRATCH_BYTES = 64 << 20
ROWS_BLOCK = 256
COLS_BLOCK = 256


@triton.jit(do_not_specialize=["width", "col_blocks", "num_pages", "words", "min_len", "sq"])
def _table_kernel(table_ptr, lens_ptr, fill_ptr, bits_ptr, flag_ptr, width, col_blocks, num_pages, words, min_len,
                  sq, PS: tl.constexpr, FILL: tl.constexpr, BLOCK: tl.constexpr):
    # a 1-D grid (row, column block): grid y stops at 65535 blocks, which a 16.7M-column table passed
    pid = tl.program_id(0).to(tl.int64)
    b = pid // col_blocks
    cols = (pid % col_blocks) * BLOCK + tl.arange(0, BLOCK)
    n = tl.load(lens_ptr + b).to(tl.int64)
    bad_len = (n < min_len) | (n > width.to(tl.int64) * PS)
    used = (cols < width) & (cols < (n + PS - 1) // PS)
    ids = tl.load(table_ptr + b * width + cols, mask=used, other=0).to(tl.int64)
    valid = used & (ids >= 0) & (ids < num_pages)
    ids = tl.where(valid, ids, 0)   # the shift and the addresses below from in-range ids only
    bit = (tl.full([BLOCK], 1, tl.int64) << (ids % 32)).to(tl.int32)  # bit 31: the sign bit, as a pattern
    old = tl.atomic_or(bits_ptr + b * words + ids // 32, bit, mask=valid)
    bad = (used & ~valid) | (valid & ((old & bit) != 0))
    if FILL:
        cached = tl.maximum(n - sq, 0)
        count = tl.minimum(tl.maximum(cached - cols * PS, 0), PS)
        tl.atomic_max(fill_ptr + ids, count.to(tl.int32), mask=valid & (count > 0))
    tl.atomic_or(flag_ptr, (bad_len | (tl.max(bad.to(tl.int32), 0) > 0)).to(tl.int64))
    tl.atomic_add(flag_ptr + 1, 1)   # programs that ran: the decision is clear only if every one did


@triton.jit(do_not_specialize=["n_tok", "n_slots", "width", "sq"])
def _rows_kernel(slot_ptr, mark_ptr, flag_ptr, n_tok, n_slots, table_ptr, lens_ptr, pos_ptr, fill_ptr, width, sq,
                 PS: tl.constexpr, PLACE: tl.constexpr, POS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    rows = i < n_tok
    s = tl.load(slot_ptr + i, mask=rows, other=-1)
    live = rows & (s != -1)
    bad = rows & ((s < -1) | (s >= n_slots))
    writes = live & (s >= 0) & (s < n_slots)
    key = s
    counted = writes
    add = tl.full([BLOCK], 1, tl.int64)
    if PLACE:
        # row i is token p = seq_lens[r] - sq + j of sequence r (a seq_lens below sq is the table
        # kernel's refusal, so p's sign and the rounding of // and % below do not matter then)
        r = i // sq
        p = tl.load(lens_ptr + r, mask=rows, other=0).to(tl.int64) - sq + i % sq
        col = tl.minimum(tl.maximum(p // PS, 0), width - 1)
        slot = tl.load(table_ptr + r * width + col, mask=rows, other=0).to(tl.int64) * PS + p % PS
        bad |= live & (s != slot)
        if POS:
            bad |= live & (tl.load(pos_ptr + i, mask=rows, other=0) != p)
        fill = tl.load(fill_ptr + s // PS, mask=writes, other=0)
        bad |= writes & (s % PS < fill)
        skips = rows & ~live & (slot >= 0) & (slot < n_slots)
        key = tl.where(live, s, slot)
        counted = writes | skips
        add = tl.where(live, add, add << 32)
    old = tl.atomic_add(mark_ptr + key, add, mask=counted)
    bad |= writes & (old != 0)
    if PLACE:
        bad |= skips & ((old & 0xFFFFFFFF) != 0)
    tl.atomic_or(flag_ptr, tl.max(bad.to(tl.int64), 0))
    tl.atomic_add(flag_ptr + 1, 1)


def _guard(t: torch.Tensor):
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def _scratch(n_slots: int, num_pages: int, bits_words: int, device) -> tuple | None:
    """One zeroed buffer (a single memset): the flag and the count of programs that ran, the per-slot
    counters (int64), the per-page fills and the (row, page) bits (int32); None past MAX_SCRATCH_BYTES."""
    n32 = num_pages + bits_words
    n64 = 2 + n_slots + (n32 + 1) // 2
    if n64 * 8 > MAX_SCRATCH_BYTES:
        return None
    buf = torch.zeros(n64, dtype=torch.int64, device=device)
    tail = buf[2 + n_slots:].view(torch.int32)
    return buf[:2], buf[2:2 + n_slots], tail[:num_pages], tail[num_pages:num_pages + bits_words]


def _grids(b: int, width: int, t: int) -> tuple[int, int] | None:
    """Programs of the table kernel (b x column blocks, 1-D) and of the rows kernel; None past a
    grid's 2**31 - 1 blocks (the caller keeps the masks)."""
    table = b * triton.cdiv(width, COLS_BLOCK)
    rows = triton.cdiv(t, ROWS_BLOCK)
    return None if max(table, rows) >= 2 ** 31 else (table, rows)


def _table(table, lens, flag, fill, bits, num_pages, ps, min_len, sq, fill_on, programs):
    b, width = table.shape
    _table_kernel[(programs,)](
        table, lens, fill, bits, flag, width, triton.cdiv(width, COLS_BLOCK), num_pages, triton.cdiv(num_pages, 32),
        min_len, sq, PS=ps, FILL=fill_on, BLOCK=COLS_BLOCK, **C.LAUNCH)


def _decided(flag, programs: int) -> bool:
    """Clear: no program flagged, and every program launched ran (fail closed: a launch that ran
    nothing would otherwise read as clear)."""
    bad, ran = flag.tolist()
    if ran != programs:
        raise RuntimeError(f"rlk_ops index checks: {ran} of the {programs} check programs ran")
    return bad == 0


def page_values_clear(page_table, seq_lens, num_pages: int, ps: int, min_len: int | None) -> bool | None:
    """check_page_values' decision (paged_kv.py ``_page_value_masks``): True when every check is
    clear; None when the scratch would pass MAX_SCRATCH_BYTES (the caller keeps the masks)."""
    b, width = page_table.shape
    grids = _grids(b, width, 0)
    scratch = _scratch(0, 0, b * triton.cdiv(num_pages, 32), page_table.device) if grids else None
    if scratch is None:
        return None
    flag, _, fill, bits = scratch
    with _guard(page_table):
        _table(C.aligned(page_table), C.aligned(seq_lens), flag, fill, bits, num_pages, ps, min_len or 0, 0, False,
               grids[0])
    return _decided(flag, grids[0])


def append_clear(slot_mapping, n_slots: int, num_pages: int, ps: int, page_table=None, seq_lens=None,
                 positions=None) -> bool | None:
    """paged_kv_append's value checks' decision (paged_kv.py ``_append_masks``): the slots, and
    with page_table / seq_lens (and positions) the page values (min_len = Sq) and the placement.
    True when every check is clear; None past MAX_SCRATCH_BYTES."""
    t = slot_mapping.shape[0]
    place = page_table is not None
    b, width = page_table.shape if place else (0, 0)
    grids = _grids(b, width, t)
    scratch = _scratch(n_slots, num_pages if place else 0, b * triton.cdiv(num_pages, 32),
                       slot_mapping.device) if grids else None
    if scratch is None:
        return None
    flag, mark, fill, bits = scratch
    slots = C.aligned(slot_mapping)
    with _guard(slot_mapping):
        if place:
            sq = t // b
            table, lens = C.aligned(page_table), C.aligned(seq_lens)
            pos = C.aligned(positions.reshape(-1)) if positions is not None else slots
            _table(table, lens, flag, fill, bits, num_pages, ps, sq, sq, True, grids[0])
        else:
            sq, table, lens, pos, width = 1, slots, slots, slots, 1
        _rows_kernel[(grids[1],)](
            slots, mark, flag, t, n_slots, table, lens, pos, fill if place else mark, width, sq,
            PS=ps, PLACE=place, POS=positions is not None, BLOCK=ROWS_BLOCK, **C.LAUNCH)
    return _decided(flag, grids[1] + (grids[0] if place else 0))
