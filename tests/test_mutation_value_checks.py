"""Edge cases of the paged-KV value checks that a mutation audit (session 40) found unpinned.

Each case is one exact boundary of a check: a slot 0 given twice, a page another row has filled to
its last slot, a page another row has cached exactly one token of, a writing row before and after
the row that skips the same slot, an out-of-range page id in a partial last page, seq_lens at the
table's capacity, a page id equal to num_pages. The torch side (the host checks that CPU tensors
take, and the device-side masks ``_append_masks`` / ``_page_value_masks``) runs in the normal
suite; the Triton kernels' decision (kernels/triton/index_checks.py) runs on CUDA or in the
interpreter (TRITON_INTERPRET=1, as make test's second run), and is compared with the expected
decision and with the masks.
"""
import os

import pytest
import torch

from rlk_ops import RlkInputError
from rlk_ops.ops import _validate as V
from rlk_ops.ops import paged_kv as P
from test_index_checks import blocks  # noqa: F401 - the kernels at their shipped blocks and at 2 x 2

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
kernels = pytest.mark.skipif(DEVICE == "cpu" and not INTERPRET,
                             reason="the Triton kernels run on CUDA or under TRITON_INTERPRET=1")
on_gpu = pytest.mark.cuda if DEVICE == "cuda" else (lambda f: f)   # as tests/test_index_checks.py marks


def _t(x, dtype):
    return torch.tensor(x, dtype=dtype)


# (name, page_size, num_pages, slots, table, seq_lens, clear): appends with a page table, Sq = T // B
APPENDS = [
    # row 0 has cached all 4 tokens of page 3; row 1 (3 cached there) writes its token 3 to page 3's last slot
    ("another row's full page, last slot", 4, 8, [20, 15], [[3, 5], [3, 6]], [5, 4], False),
    # the same rows, row 1 with its own page: clear
    ("another row's full page, own page", 4, 8, [20, 24], [[3, 5], [6, 3]], [5, 1], True),
    # row 0 has cached exactly one token of page 3 (offset 0); row 1 writes its token 0 there
    ("another row's one cached token", 4, 8, [13, 12], [[3], [3]], [2, 1], False),
    # the writer before and after the row that skips (-1) the same token's slot
    ("writer before the skipping row", 2, 8, [8, -1], [[4], [4]], [1, 1], False),
    ("writer after the skipping row", 2, 8, [-1, 8], [[4], [4]], [1, 1], False),
    ("two skipping rows share a slot", 2, 8, [-1, -1], [[4], [4]], [1, 1], True),
    # slot 0 twice (both rows' tables put their token 0 at slot 0: page 0 shared, nothing cached)
    ("slot 0 twice", 4, 8, [0, 0], [[0], [0]], [1, 1], False),
    # a skipped token at slot 0 that another row writes
    ("a skipped token at slot 0 written", 4, 8, [0, -1], [[0], [0]], [1, 1], False),
    # seq_lens at the capacity (2 pages x 4): clear; one page id == num_pages in the partial last page
    ("seq_lens at capacity", 4, 8, [31], [[2, 7]], [8], True),
    # (the row skips: its token's slot 33 is past the cache, so only the page id check sees it)
    ("page id == num_pages in the partial last page", 4, 8, [-1], [[1, 8]], [6], False),
    # slot == n_slots, and n_slots - 1 where the table puts the token
    ("slot == n_slots", 4, 8, [32], [[7]], [1], False),
    ("slot == n_slots - 1", 4, 8, [31], [[7]], [4], True),
]


def _case(ps, num_pages, slots, table, lens):
    return (_t(slots, torch.int64), _t(table, torch.int32), _t(lens, torch.int32), num_pages, ps)


def _host_clear(slots, table, lens, num_pages, ps) -> bool:
    """The op on CPU tensors (the host checks): clear when it writes; a refusal leaves the cache as it was."""
    kc = torch.zeros(num_pages, ps, 1, 2)
    vc = torch.zeros(num_pages, ps, 1, 2)
    k = torch.ones(slots.shape[0], 1, 2)
    try:
        torch.ops.rlk.paged_kv_append(kc, vc, k, k.clone(), slots, table, lens, None)
    except RlkInputError:
        assert torch.equal(kc, torch.zeros_like(kc)) and torch.equal(vc, torch.zeros_like(vc))
        return False
    return True


@pytest.mark.parametrize("name,ps,num_pages,slots,table,lens,clear", APPENDS, ids=[c[0] for c in APPENDS])
def test_host_checks_decide_each_edge(name, ps, num_pages, slots, table, lens, clear):
    assert _host_clear(*_case(ps, num_pages, slots, table, lens)) is clear


@pytest.mark.parametrize("name,ps,num_pages,slots,table,lens,clear", APPENDS, ids=[c[0] for c in APPENDS])
def test_device_masks_decide_each_edge(name, ps, num_pages, slots, table, lens, clear):
    """The masks CUDA tensors take: their decision alone (no host fallback), and through the op."""
    s, tab, ln, n_pages, p = _case(ps, num_pages, slots, table, lens)
    assert V.all_clear(*P._append_masks(s, n_pages * p, n_pages, p, tab, ln, None)) is clear


@pytest.mark.parametrize("name,ps,num_pages,slots,table,lens,clear", APPENDS, ids=[c[0] for c in APPENDS])
def test_device_path_op_decides_each_edge(name, ps, num_pages, slots, table, lens, clear, monkeypatch):
    monkeypatch.setattr(V, "on_device", lambda t: True)
    assert _host_clear(*_case(ps, num_pages, slots, table, lens)) is clear


def test_slot_zero_twice_is_named_without_a_table(monkeypatch):
    """Slots only: slot 0 given twice is a duplicate, on the host and through the masks."""
    kc, vc = torch.zeros(4, 4, 1, 2), torch.zeros(4, 4, 1, 2)
    k = torch.ones(2, 1, 2)
    for device_path in (False, True):
        if device_path:
            monkeypatch.setattr(V, "on_device", lambda t: True)
        with pytest.raises(RlkInputError, match=r"slot_mapping\[1\] = 0 duplicates slot_mapping\[0\]"):
            torch.ops.rlk.paged_kv_append(kc, vc, k, k.clone(), _t([0, 0], torch.int64), None, None, None)
        assert torch.equal(kc, torch.zeros_like(kc)) and torch.equal(vc, torch.zeros_like(vc))
    assert V.all_clear(*P._append_masks(_t([0, 0], torch.int64), 16, 4, 4, None, None, None)) is False
    assert V.all_clear(*P._append_masks(_t([0, -1, -1], torch.int64), 16, 4, 4, None, None, None)) is True


# (page_size, num_pages, table, seq_lens, min_len, clear)
PAGES = [
    (4, 8, [[2, 7]], [8], None, True),            # seq_lens at capacity
    (4, 8, [[2, 7]], [9], None, False),           # one past
    (4, 8, [[1, 8]], [6], None, False),           # id == num_pages in the partial last page
    (4, 8, [[1, 7]], [6], None, True),
    (4, 8, [[1, 8]], [4], None, True),            # the same id past the used pages: padding
    (4, 8, [[1, 7]], [2], 3, False),              # seq_lens below min_len
    (4, 8, [[1, 7]], [3], 3, True),
]


@pytest.mark.parametrize("ps,num_pages,table,lens,min_len,clear", PAGES)
def test_page_value_masks_decide_each_edge(ps, num_pages, table, lens, min_len, clear):
    got = V.all_clear(*P._page_value_masks(_t(table, torch.int32), _t(lens, torch.int32), num_pages, ps, min_len))
    assert got is clear


@kernels
@on_gpu
@pytest.mark.parametrize("name,ps,num_pages,slots,table,lens,clear", APPENDS, ids=[c[0] for c in APPENDS])
@pytest.mark.parametrize("with_pos", [False, True])
def test_kernel_decides_each_edge(name, ps, num_pages, slots, table, lens, clear, with_pos, blocks):
    ic = blocks
    s, tab, ln, n_pages, p = _case(ps, num_pages, slots, table, lens)
    pos = None
    if with_pos:
        sq = s.shape[0] // tab.shape[0]
        pos = (ln.long()[:, None] - sq + torch.arange(sq)).reshape(-1)
    got = ic.append_clear(s.to(DEVICE), n_pages * p, n_pages, p, tab.to(DEVICE), ln.to(DEVICE),
                          None if pos is None else pos.to(DEVICE))
    assert got is clear
    assert V.all_clear(*P._append_masks(s, n_pages * p, n_pages, p, tab, ln, pos)) is clear


@kernels
@on_gpu
@pytest.mark.parametrize("ps,num_pages,table,lens,min_len,clear", PAGES)
def test_kernel_page_values_decide_each_edge(ps, num_pages, table, lens, min_len, clear, blocks):
    got = blocks.page_values_clear(_t(table, torch.int32).to(DEVICE), _t(lens, torch.int32).to(DEVICE), num_pages, ps,
                               min_len)
    assert got is clear


@kernels
@on_gpu
def test_kernel_slots_only_edges(blocks):
    ic = blocks
    for slots, clear in (([0, 0], False), ([0, -1, -1], True), ([16], False), ([15, -1], True), ([-2], False)):
        assert ic.append_clear(_t(slots, torch.int64).to(DEVICE), 16, 4, 4) is clear, slots
