"""What paged_kv_append's value checks cost on CUDA, per decode step (eager, host time included).

A decode step appends one K/V row per sequence. Given ``page_table`` and ``seq_lens`` (and
``positions``), as the block's forward_rollout passes them, the op checks on the device, in one sync
(rlk_ops/ops/paged_kv.py): the slots in range and distinct; seq_lens and the used page ids; each
slot where the tables put its token; no slot holding a token another row has cached (session 31:
``_cached_fill`` / ``_held``). Timed here, per case and in one run, each call followed by a
synchronize (the checks sync anyway), the variants interleaved round by round:

* ``kernel``: the backend's append kernel alone (no op, no checks);
* ``op_unchecked``: the op with every argument, under ``rlk_ops.value_checks(False)``;
* ``op_slots``: the op without page_table / seq_lens, checks on (range and duplicates only);
* ``op_placement``: the op with page_table, seq_lens and positions, checks on (the rollout path);
* ``op_slots_host`` / ``op_placement_host``: the same with the checks on their host path (the index
  tensors copied to the CPU, checked there: what CPU tensors take), to compare the two paths;
* ``op_slots_masks`` / ``op_placement_masks``: the device decision as torch masks (the route before
  kernels/triton/index_checks.py, and the route past its scratch budget);
* ``page_values`` / ``page_values_masks``: check_page_values alone, as paged_attention and gather
  run it each call (seq_lens and page ids), by the Triton kernel and by the masks.

Every variant's caches are checked torch.equal to the kernel's after the same append, and one bad
call (a slot in a page another sequence has filled) must raise and leave the caches unchanged.
Usage (GPU): python3 benchmarks/append_checks.py --out DIR   (--device cpu --rounds 1 --calls 2: a dry run)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import rlk_ops  # noqa: E402
from rlk_ops import RlkInputError  # noqa: E402
from rlk_ops.kernels.dispatch import kernel_for  # noqa: E402
from rlk_ops.ops import _validate as V  # noqa: E402
from rlk_ops.ops import paged_kv as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _report import source_digest  # noqa: E402

HKV, D, CONTEXT = 4, 128, 8192


def case_args(batch: int, ps: int, dev: str):
    """Caches for ``batch`` sequences of CONTEXT tokens (the last one new), pages shuffled."""
    per_seq = CONTEXT // ps
    num_pages = batch * per_seq + 8
    g = torch.Generator().manual_seed(batch * 1000 + ps)
    kc = torch.randn(num_pages, ps, HKV, D, generator=g).to(torch.bfloat16).to(dev)
    vc = torch.randn(num_pages, ps, HKV, D, generator=g).to(torch.bfloat16).to(dev)
    table = torch.randperm(num_pages, generator=g)[:batch * per_seq].view(batch, per_seq).int()
    lens = torch.full((batch,), CONTEXT, dtype=torch.int32)
    pos = (lens.long() - 1)[:, None]
    slots = (table.long().gather(1, pos // ps) * ps + pos % ps).reshape(-1)
    k = torch.randn(batch, HKV, D, generator=g).to(torch.bfloat16)
    v = torch.randn(batch, HKV, D, generator=g).to(torch.bfloat16)
    return [t.to(dev) for t in (kc, vc, k, v, slots, table, lens, pos)]


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def eager_us(fn, calls: int) -> float:
    _sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
        _sync()
    return (time.perf_counter() - t0) * 1e6 / calls


def run_case(batch: int, ps: int, dev: str, rounds: int, calls: int) -> dict:
    kc, vc, k, v, slots, table, lens, pos = case_args(batch, ps, dev)
    kernel = kernel_for("paged_kv_append", kc.device, mutated=(0, 1))
    op = torch.ops.rlk.paged_kv_append

    def unchecked():
        with rlk_ops.value_checks(False):
            op(kc, vc, k, v, slots, table, lens, pos)

    def patched(module, name, value, fn):  # fn run with module.name replaced by value
        def run():
            saved = getattr(module, name)
            setattr(module, name, value)
            try:
                fn()
            finally:
                setattr(module, name, saved)
        return run

    def on_host(fn):  # the checks' host path (V.on_device False): copies to the host, the checks there
        return patched(V, "on_device", lambda t: False, fn)

    def masks(fn):  # the device decision by the torch masks (paged_kv._fused declines)
        return patched(P, "_fused", lambda *a: None, fn)

    def page_values():
        P.check_page_values("paged_attention", kc, table, lens, min_len=1)

    fns = {"kernel": lambda: kernel(kc, vc, k, v, slots),
           "op_unchecked": unchecked,
           "op_slots": lambda: op(kc, vc, k, v, slots, None, None, None),
           "op_placement": lambda: op(kc, vc, k, v, slots, table, lens, pos),
           "op_slots_host": on_host(lambda: op(kc, vc, k, v, slots, None, None, None)),
           "op_placement_host": on_host(lambda: op(kc, vc, k, v, slots, table, lens, pos)),
           "op_slots_masks": masks(lambda: op(kc, vc, k, v, slots, None, None, None)),
           "op_placement_masks": masks(lambda: op(kc, vc, k, v, slots, table, lens, pos)),
           "page_values": page_values, "page_values_masks": masks(page_values)}
    # bits: each variant's append on fresh copies equals the kernel's
    ref = kc.clone(), vc.clone()
    kernel(*ref, k, v, slots)
    equal = {}
    for name, fn in fns.items():
        if name.startswith("page_values"):  # a check alone: nothing appended
            continue
        saved = kc.clone(), vc.clone()
        fn()
        equal[name] = torch.equal(kc, ref[0]) and torch.equal(vc, ref[1])
        kc.copy_(saved[0]), vc.copy_(saved[1])
    # a refused call: sequence 0's new token placed in a page sequence 1 has filled
    bad_table = table.clone()
    bad_table[0, -1] = table[1, 0]
    before = kc.clone(), vc.clone()
    try:
        op(kc, vc, k, v, (bad_table.long()[:, -1] * ps + (CONTEXT - 1) % ps), bad_table, lens, pos)
        refused = "not refused"
    except RlkInputError as e:
        refused = str(e)
    refused_unchanged = torch.equal(kc, before[0]) and torch.equal(vc, before[1])
    for fn in fns.values():  # warm-up
        fn()
    samples = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(eager_us(fn, calls))
    us = {name: round(statistics.median(t), 2) for name, t in samples.items()}
    return {"batch": batch, "page_size": ps, "context": CONTEXT, "hkv": HKV, "head_dim": D,
            "route": P.device_check_route(kc.device), "us": us,
            "spread_us": {n: round(max(t) - min(t), 2) for n, t in samples.items()},
            "placement_checks_us": round(us["op_placement"] - us["op_unchecked"], 2),
            "equal_to_kernel": equal, "bad_call_refused": refused, "bad_call_left_cache_unchanged": refused_unchanged}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script (the CPU op always checks)")
    a = ap.parse_args()
    dev = a.device
    res = {"script": "benchmarks/append_checks.py",
           "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
           "torch": torch.__version__, "source_digest": source_digest(), "cases": []}
    for batch in (8, 64):
        for ps in (16, 128):
            res["cases"].append(run_case(batch, ps, dev, a.rounds, a.calls))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "append_checks.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"value-check route: {res['cases'][0]['route']}")
    print("| batch | page | kernel | op, checks off | op, slot checks | op, placement checks | "
          "placement checks cost | slot checks, masks | placement checks, masks | slot checks, host path | "
          "placement checks, host path | page values | page values, masks | bits | bad call |")
    print("|" + "---|" * 15)
    for c in res["cases"]:
        u = c["us"]
        ok = all(c["equal_to_kernel"].values())
        bad = c["bad_call_refused"].startswith("rlk::paged_kv_append") and c["bad_call_left_cache_unchanged"]
        print(f"| {c['batch']} | {c['page_size']} | {u['kernel']} | {u['op_unchecked']} | {u['op_slots']} | "
              f"{u['op_placement']} | +{c['placement_checks_us']} | {u['op_slots_masks']} | "
              f"{u['op_placement_masks']} | {u['op_slots_host']} | {u['op_placement_host']} | "
              f"{u['page_values']} | {u['page_values_masks']} | {'equal' if ok else 'DIFFER'} | "
              f"{'refused, cache unchanged' if bad else 'NOT REFUSED'} |")


if __name__ == "__main__":
    main()
