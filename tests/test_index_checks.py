"""rlk_ops/kernels/triton/index_checks.py: the paged-KV value checks' decision on the GPU.

The kernels must decide exactly what the device-side masks of rlk_ops/ops/paged_kv.py decide
(``_append_masks``, ``_page_value_masks``): "every check clear" or not. A kernel that called a bad
append clear would let it write the cache; one that called a good append bad would send every call
to the slow host path. Random near-valid appends (small caches, pages shared between rows, rows
that skip with -1, then one or two perturbations, with the slots sometimes recomputed from the
perturbed table so that only the subtler checks catch it) are compared one by one; the test asserts
that each check was the only one failing in some compared case, so each part of the kernels had to
decide a case alone.

Runs on the GPU (``cuda``) and in the Triton interpreter on CPU (TRITON_INTERPRET=1: make test's
second run); otherwise the kernel tests skip.
"""
import os
import random

import pytest
import torch

from rlk_ops.ops import paged_kv as P

triton = pytest.importorskip("triton")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
needs_kernels = pytest.mark.skipif(DEVICE == "cpu" and not INTERPRET,
                                   reason="the Triton kernels run on CUDA or under TRITON_INTERPRET=1")
pytestmark = [pytest.mark.cuda] if DEVICE == "cuda" else []

CHECKS = ["slot range", "slot duplicate", "seq_lens range", "page id range", "page twice in a row",
          "slot not the token's", "positions", "another row's cached token", "a skipped row's token"]


def _kernels():
    from rlk_ops.kernels.triton import index_checks
    return index_checks


def _valid(rng: random.Random, ps: int, b: int, sq: int, num_pages: int):
    """A valid append: b sequences with sq new tokens each; later rows may share the earlier rows'
    full cached pages (a prefix); some rows skip (-1). None if the pages run out."""
    pages = list(range(num_pages))
    rng.shuffle(pages)
    cached = [rng.randint(0, 3 * ps) for _ in range(b)]
    lens = [c + sq for c in cached]
    width = max(-(-n // ps) for n in lens) + rng.randint(0, 2)
    table = [[rng.randint(-5, num_pages + 5) for _ in range(width)] for _ in range(b)]   # padding: anything
    for r in range(b):
        shared = 0
        if r and rng.random() < 0.6:   # share row 0's full cached pages, as far as both hold full pages
            shared = min(cached[0] // ps, cached[r] // ps)
            table[r][:shared] = table[0][:shared]
        for j in range(shared, -(-lens[r] // ps)):
            if not pages:
                return None
            table[r][j] = pages.pop()
    slots, pos = [], []
    for r in range(b):
        for j in range(sq):
            p = lens[r] - sq + j
            slots.append(table[r][p // ps] * ps + p % ps if rng.random() > 0.15 else -1)
            pos.append(p)
    return slots, table, lens, pos


def _perturb(rng, ps, sq, num_pages, slots, table, lens, pos):
    t, b = len(slots), len(lens)
    kind = rng.randrange(7)
    i, r = rng.randrange(t), rng.randrange(b)
    c = rng.randrange(len(table[0]))
    if kind == 0:
        slots[i] = rng.randint(-3, num_pages * ps + 2) if rng.random() < 0.8 else rng.choice((2 ** 63 - 1, -2 ** 63))
    elif kind == 1:
        slots[i] = slots[rng.randrange(t)]
    elif kind == 2:
        pos[i] += rng.choice((-1, 1))
    elif kind == 3:
        lens[r] = max(0, lens[r] + rng.choice((-ps - 1, -1, 1, ps, len(table[0]) * ps)))
        if rng.random() < 0.2:   # garbage: negative, and int32's ends
            lens[r] = rng.choice((-1, -sq - 5, 2 ** 31 - 1, -2 ** 31))
    elif kind == 4:
        table[r][c] = rng.randint(-2, num_pages + 1) if rng.random() < 0.8 else rng.choice((2 ** 31 - 1, -2 ** 31))
    else:   # another entry's page, in this row or another
        table[r][c] = table[rng.randrange(b)][rng.randrange(len(table[0]))]
    if rng.random() < 0.5:   # the live slots follow the table again: only the page and fill checks see it
        for k in range(t):
            rr, p = k // sq, lens[k // sq] - sq + k % sq
            if slots[k] != -1 and 0 <= p // ps < len(table[0]) and p >= 0:
                slots[k] = max(-2 ** 63, min(table[rr][p // ps] * ps + p % ps, 2 ** 63 - 1))


def _cases(seed: int, n: int):
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        ps, b, sq = rng.choice((1, 2, 4, 16)), rng.randint(1, 4), rng.randint(1, 3)
        num_pages = rng.randint(4, 24)
        case = _valid(rng, ps, b, sq, num_pages)
        if case is None:
            continue
        slots, table, lens, pos = case
        for _ in range(rng.choice((0, 1, 1, 2))):
            _perturb(rng, ps, sq, num_pages, slots, table, lens, pos)
        with_pos = rng.random() < 0.8
        tab = torch.tensor(table, dtype=torch.int32)
        if rng.random() < 0.3:   # a strided view: the kernels take a contiguous copy
            tab = tab.t().contiguous().t()
        p = torch.tensor(pos, dtype=torch.int64)
        out.append((ps, num_pages, torch.tensor(slots, dtype=torch.int64), tab, torch.tensor(lens, dtype=torch.int32),
                    (p.view(b, sq) if rng.random() < 0.7 else p) if with_pos else None))
    return out


def _failing(case) -> list[str]:
    ps, num_pages, slots, table, lens, pos = case
    masks = P._append_masks(slots, num_pages * ps, num_pages, ps, table, lens, pos)
    names = CHECKS if pos is not None else [n for n in CHECKS if n != "positions"]
    return [name for name, m in zip(names, masks, strict=True) if bool(m.any())]


def _selected(seed=0, n=6000, per_signature=12):
    """Up to ``per_signature`` cases for each set of failing checks (the interpreter runs a few
    hundred kernel launches in seconds, not thousands)."""
    picked, count = [], {}
    for case in _cases(seed, n):
        sig = tuple(_failing(case))
        if count.get(sig, 0) < per_signature:
            count[sig] = count.get(sig, 0) + 1
            picked.append((case, sig))
    return picked


@pytest.fixture(params=["blocks 256", "blocks 2"])
def blocks(request, monkeypatch):
    """The kernels' blocks as shipped (one program per kernel for these small cases), and 2 rows /
    2 columns per program, so that every case runs many programs: the per-slot counters, the (row,
    page) bits, the fills and the flag are then shared between programs (a review of session 33: a
    kernel that looked at its first block only passed with one program)."""
    ic = _kernels()
    if request.param == "blocks 2":
        monkeypatch.setattr(ic, "ROWS_BLOCK", 2)
        monkeypatch.setattr(ic, "COLS_BLOCK", 2)
    return ic


@needs_kernels
def test_append_decision_equals_the_masks(blocks):
    ic = blocks
    picked = _selected()
    alone = set()
    for (ps, num_pages, slots, table, lens, pos), sig in picked:
        args = [x.to(DEVICE) if x is not None else None for x in (slots, table, lens, pos)]
        got = ic.append_clear(args[0], num_pages * ps, num_pages, ps, *args[1:])
        assert got == (not sig), (f"kernel says {'clear' if got else 'not clear'}, the masks fail {list(sig)}: "
                                  f"page_size {ps}, {num_pages} pages, slots {slots.tolist()}, table "
                                  f"{table.tolist()}, seq_lens {lens.tolist()}, positions "
                                  f"{None if pos is None else pos.tolist()}")
        if len(sig) == 1:
            alone.add(sig[0])
    assert () in {s for _, s in picked}, "no clear case compared"
    # with a table an out-of-range slot is never where the table puts a token, so "slot range" is
    # never alone here: the slots-only test has it alone
    want = set(CHECKS) - {"slot range"}
    assert alone == want, f"checks never the only failure in a compared case: {want - alone}"


@needs_kernels
def test_slots_only_decision_equals_the_masks(blocks):
    ic = blocks
    rng = random.Random(1)
    seen = set()
    for _ in range(150):
        n_slots, t = rng.randint(1, 40), rng.randint(1, 12)
        slots = torch.tensor([rng.randint(-3, n_slots + 1) if rng.random() < 0.3 else rng.randrange(n_slots)
                              for _ in range(t)], dtype=torch.int64)
        masks = P._append_masks(slots, n_slots, 1, n_slots, None, None, None)
        sig = tuple(name for name, m in zip(CHECKS[:2], masks, strict=True) if bool(m.any()))
        assert ic.append_clear(slots.to(DEVICE), n_slots, 1, n_slots) == (not sig), slots.tolist()
        seen.add(sig)
    assert {(), ("slot range",), ("slot duplicate",)} <= seen


@needs_kernels
def test_page_values_decision_equals_the_masks(blocks):
    ic = blocks
    picked = _selected(seed=2, n=1500, per_signature=30)
    seen = set()
    for (ps, num_pages, _, table, lens, _), _ in picked:
        for min_len in (None, 0, 3):
            want = P.V.all_clear(*P._page_value_masks(table, lens, num_pages, ps, min_len))
            got = ic.page_values_clear(table.to(DEVICE), lens.to(DEVICE), num_pages, ps, min_len)
            assert got == want, (ps, num_pages, table.tolist(), lens.tolist(), min_len)
            seen.add(want)
    assert seen == {True, False}


@needs_kernels
@pytest.mark.parametrize("page", [31, 63, 0, 32])
def test_a_page_twice_at_every_bit_of_its_word(page):
    """The (row, page) bits are int32 words: page 31 is the sign bit."""
    ic = _kernels()
    lens = torch.tensor([3, 3], dtype=torch.int32, device=DEVICE)
    table = torch.tensor([[page, 5, page], [page, 7, 9]], dtype=torch.int32, device=DEVICE)
    assert ic.page_values_clear(table, lens, 64, 1, None) is False
    assert ic.page_values_clear(table[:, :2].contiguous(), torch.tensor([2, 2], dtype=torch.int32, device=DEVICE),
                                64, 1, None) is True   # two rows sharing a page: allowed


@needs_kernels
def test_two_skipping_rows_may_share_a_slot():
    """Padding rows (-1) whose tables put their tokens in one slot conflict with nobody; a writing
    row in that slot does."""
    ic = _kernels()
    table = torch.tensor([[4], [4]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([1, 1], dtype=torch.int32, device=DEVICE)
    skip = torch.tensor([-1, -1], dtype=torch.int64, device=DEVICE)
    assert ic.append_clear(skip, 16, 8, 2, table, lens) is True
    write = torch.tensor([8, -1], dtype=torch.int64, device=DEVICE)
    assert ic.append_clear(write, 16, 8, 2, table, lens) is False
    assert P.V.all_clear(*P._append_masks(write.cpu(), 16, 8, 2, table.cpu(), lens.cpu(), None)) is False


@needs_kernels
def test_past_the_scratch_budget_the_caller_keeps_the_masks(monkeypatch):
    ic = _kernels()
    slots = torch.tensor([0, 1], dtype=torch.int64, device=DEVICE)
    monkeypatch.setattr(ic, "MAX_SCRATCH_BYTES", 8)
    assert ic.append_clear(slots, 1 << 20, 1 << 16, 16) is None
    assert ic.page_values_clear(torch.zeros(2, 1, dtype=torch.int32, device=DEVICE),
                                torch.ones(2, dtype=torch.int32, device=DEVICE), 1 << 20, 16, None) is None


@needs_kernels
def test_a_program_that_did_not_run_is_not_clear():
    """The decision is read with the count of programs that ran; short of the launch, it raises."""
    ic = _kernels()
    assert ic._decided(torch.tensor([0, 4]), 4) is True
    assert ic._decided(torch.tensor([1, 4]), 4) is False
    with pytest.raises(RuntimeError, match=r"3 of the 4 check programs ran"):
        ic._decided(torch.tensor([0, 3]), 4)


def test_the_route_each_device_takes():
    assert P.device_check_route(torch.device("cpu")).startswith("masks: ")
    route = P.device_check_route(torch.device("cuda"))
    if INTERPRET:
        assert route.startswith("masks: TRITON_INTERPRET=1")
    else:
        assert route == "triton"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs a CUDA GPU")
def test_the_op_on_cuda_takes_the_kernels_and_refuses_as_on_cpu(monkeypatch):
    """A bad append through the op on CUDA: the kernels decide (their function ran), the host path
    names the offender with the CPU's message, the cache is untouched; a good one is clear."""
    from rlk_ops import RlkInputError
    ic = _kernels()
    calls = []
    real = ic.append_clear
    monkeypatch.setattr(ic, "append_clear", lambda *a, **k: calls.append(1) or real(*a, **k))
    kc = torch.randn(8, 4, 2, 8).to(torch.bfloat16)
    vc = torch.randn(8, 4, 2, 8).to(torch.bfloat16)
    k = torch.randn(2, 2, 8).to(torch.bfloat16)
    v = torch.randn(2, 2, 8).to(torch.bfloat16)
    table = torch.tensor([[3, 5], [3, 6]], dtype=torch.int32)   # page 3 shared: row 0 has 4 cached there
    lens = torch.tensor([6, 5], dtype=torch.int32)
    good = torch.tensor([5 * 4 + 1, 6 * 4 + 0], dtype=torch.int64)
    bad = torch.tensor([5 * 4 + 1, 3 * 4 + 0], dtype=torch.int64)
    bad_table = torch.tensor([[3, 5], [6, 3]], dtype=torch.int32)   # row 1's token 4 would land in page 3
    messages = {}
    for dev in ("cpu", "cuda"):
        kcd, vcd = kc.to(dev), vc.to(dev)
        before = kcd.clone(), vcd.clone()
        with pytest.raises(RlkInputError) as e:
            torch.ops.rlk.paged_kv_append(kcd, vcd, k.to(dev), v.to(dev), bad.to(dev), bad_table.to(dev),
                                          lens.to(dev), None)
        messages[dev] = str(e.value)
        assert torch.equal(kcd, before[0]) and torch.equal(vcd, before[1])
        torch.ops.rlk.paged_kv_append(kcd, vcd, k.to(dev), v.to(dev), good.to(dev), table.to(dev), lens.to(dev), None)
    assert messages["cpu"] == messages["cuda"]
    assert len(calls) == 2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs a CUDA GPU")
def test_a_table_wider_than_grid_y_allows():
    """65,535 x 256 + 1 columns: on a 2-D grid the table kernel's launch failed ('invalid argument')
    on a valid call (a review of session 33); the grid is 1-D now."""
    ic = _kernels()
    width = 65535 * ic.COLS_BLOCK + 1
    table = torch.zeros(1, width, dtype=torch.int32, device="cuda")
    lens = torch.ones(1, dtype=torch.int32, device="cuda")
    assert ic.page_values_clear(table, lens, 4, 16, 1) is True
    assert ic.append_clear(torch.zeros(1, dtype=torch.int64, device="cuda"), 64, 4, 16, table, lens) is True
    table[0, 0] = 9   # out of range
    assert ic.page_values_clear(table, lens, 4, 16, 1) is False


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs a CUDA GPU")
def test_past_the_budget_the_op_refuses_through_the_masks(monkeypatch):
    """Past the kernels' scratch budget the op decides by the torch masks: a bad append is still
    refused with the CPU's message and the cache left as it was; a good one writes."""
    from rlk_ops import RlkInputError
    ic = _kernels()
    monkeypatch.setattr(ic, "MAX_SCRATCH_BYTES", 8)
    kc = torch.randn(8, 4, 2, 8, device="cuda").to(torch.bfloat16)
    vc = torch.randn(8, 4, 2, 8, device="cuda").to(torch.bfloat16)
    k = torch.randn(2, 2, 8, device="cuda").to(torch.bfloat16)
    table = torch.tensor([[3, 5], [6, 3]], dtype=torch.int32, device="cuda")
    lens = torch.tensor([6, 5], dtype=torch.int32, device="cuda")
    bad = torch.tensor([5 * 4 + 1, 3 * 4 + 0], dtype=torch.int64, device="cuda")
    before = kc.clone()
    with pytest.raises(RlkInputError, match=r"holds token 0 of sequence 0, already cached"):
        torch.ops.rlk.paged_kv_append(kc, vc, k, k, bad, table, lens, None)
    assert torch.equal(kc, before)
    good_table = torch.tensor([[3, 5], [3, 6]], dtype=torch.int32, device="cuda")
    good = torch.tensor([5 * 4 + 1, 6 * 4 + 0], dtype=torch.int64, device="cuda")
    torch.ops.rlk.paged_kv_append(kc, vc, k, k, good, good_table, lens, None)
    assert torch.equal(kc[5, 1], k[0]) and torch.equal(kc[6, 0], k[1])
