"""What the benchmark scripts share: the JSON report, its sections and the random inputs.

``benchmarks/attention.py`` and ``benchmarks/canonical.py`` subclass ``Report``.
``graph_time_us`` is the CUDA-graph timer of ``canonical.py`` and ``kernel_bench.py``
(``graph_times_us``: several functions' graphs replayed in turn, for ratios);
``attention.py`` keeps its own (fixed 10 calls per graph, replays interleaved with the
raw kernel's, as its report says).
A section that raises is recorded in ``res["errors"]`` with its traceback, the others
still run, and the report is saved after every section, so a fault late in a GPU session
loses nothing measured before it.
Every report carries ``source_digest``: a sha256 over the package's and the benchmarks' Python
sources as they ran, so a result names its code even where the machine's git metadata is stale
(session 11: the device's ``git rev-parse HEAD`` printed the session's first commit). Check a
commit against it with ``python3 benchmarks/_report.py digest`` in a checkout of that commit.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import asdict

import torch


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def source_digest(root: str = ROOT) -> str:
    """sha256 of rlk_ops/**/*.py and benchmarks/*.py (relative paths and contents, sorted)."""
    if root not in sys.path:   # the checkout's rlk_ops, also where the package is not installed
        sys.path.insert(0, root)
    from rlk_ops.meta.probe import tree_digest
    return tree_digest(root, ("rlk_ops", "benchmarks"))


def _calls_for(fn, target_ms: float, max_calls: int) -> int:
    """How many calls of ``fn`` fill ``target_ms`` (from 3 timed calls; 3..max_calls)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        fn()
    end.record()
    end.synchronize()
    return max(3, min(max_calls, int(target_ms / max(start.elapsed_time(end) / 3, 1e-3))))


def _capture(fn, n: int):
    """``n`` calls of ``fn`` captured in one CUDA graph on a side stream."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(n):
                fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    return g


def _replay_us(g, n: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / n


def graph_time_us(fn, target_ms: float = 8.0, reps: int = 5, max_calls: int = 500, graph: bool = True,
                  fallback: bool = False) -> dict:
    """GPU time per call of ``fn``: ``n`` calls (sized to ``target_ms`` from 3 timed calls,
    3..max_calls) captured in one CUDA graph on a side stream, the graph replayed ``reps``
    times between two events. Returns ``{"us": median, "spread_us", "method", "n"}``.
    ``graph=False`` times the ``n`` calls eagerly between the events instead (host launch
    cost included); ``fallback=True`` does that, recorded in ``method``, when capture fails
    (else the capture error propagates)."""
    n = _calls_for(fn, target_ms, max_calls)
    method, samples = "cuda_graph", []
    if graph:
        try:
            g = _capture(fn, n)
            samples = [_replay_us(g, n) for _ in range(reps)]
            del g
        except Exception as e:  # noqa: BLE001 - re-raised unless the caller asked for the eager fallback
            if not fallback:
                raise
            method, samples = f"events (graph capture failed: {type(e).__name__})", []
            torch.cuda.synchronize()
    if not samples:
        method = method if method != "cuda_graph" else "events"
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(reps):
            start.record()
            for _ in range(n):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3 / n)
    return {"us": statistics.median(samples), "spread_us": max(samples) - min(samples), "method": method, "n": n}


def graph_times_us(fns: dict, target_ms: float = 8.0, reps: int = 5, max_calls: int = 500) -> dict:
    """``graph_time_us`` of several functions whose ratios are compared: each captured in its
    own CUDA graph, the graphs replayed in turn (A, B, C, A, B, C, ...) ``reps`` rounds, so a
    drift of the GPU's clock or temperature during the measurement falls on all of them
    alike. Returns ``{name: {"us": median, "spread_us", "method", "n"}}``."""
    graphs = {}
    for name, fn in fns.items():
        n = _calls_for(fn, target_ms, max_calls)
        graphs[name] = (_capture(fn, n), n)
    graphs_n = {name: n for name, (_, n) in graphs.items()}
    samples = {name: [] for name in fns}
    for _ in range(reps):
        for name, (g, n) in graphs.items():
            samples[name].append(_replay_us(g, n))
    del graphs
    return {name: {"us": statistics.median(t), "spread_us": max(t) - min(t), "method": "cuda_graph, interleaved",
                   "n": graphs_n[name]} for name, t in samples.items()}


class Report:
    def __init__(self, script: str, dev: str, shapes, out_path: str, dry: bool):
        self.dev, self.sh, self.out_path, self.dry = dev, shapes, out_path, dry
        self.gen = torch.Generator(device=dev).manual_seed(0)
        self.res = {"script": script, "dry_run": dry, "command": " ".join(sys.argv),
                    "started": time.strftime("%Y-%m-%d %H:%M:%S"), "shapes": asdict(shapes), "bitwise": [],
                    "errors": {}, "section_seconds": {},
                    "source_digest": source_digest()}

    def rand(self, *shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device=self.dev, generator=self.gen).to(dtype)

    def sync(self):
        if self.dev == "cuda":
            torch.cuda.synchronize()

    def save(self):
        self.res["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        with open(self.out_path, "w") as f:
            json.dump(self.res, f, indent=1, default=str)

    def section(self, name, fn):
        print(f"== {name}", flush=True)
        t0 = time.perf_counter()
        try:
            fn()
        except Exception:  # recorded; the other sections still run; the exit status says it failed
            self.res["errors"][name] = traceback.format_exc()
            print(self.res["errors"][name], flush=True)
        self.res["section_seconds"][name] = round(time.perf_counter() - t0, 1)
        self.save()
        if self.dev == "cuda":
            try:
                torch.cuda.empty_cache()
            except Exception:  # noqa: BLE001 - a faulted context (recorded above) must not lose the report
                self.res["errors"].setdefault(name, traceback.format_exc())

    def run_sections(self, sections, only: str = "") -> None:
        """Run ``(name, fn)`` sections in order; ``only`` (comma-separated names) picks a subset,
        environment sections always run."""
        chosen = set(filter(None, only.split(",")))
        for name, fn in sections:
            if not chosen or name in chosen or name.startswith("environment"):
                self.section(name, fn)

    def finish(self, t0: float, md_path: str, markdown, summary) -> int:
        """Save the report and its markdown, print the summary; exit status 0 only when every
        bitwise cell holds and no section failed."""
        r = self.res
        r["all_bitwise_true"] = bool(r["bitwise"]) and all(c["equal"] for c in r["bitwise"])
        r["total_seconds"] = round(time.perf_counter() - t0, 1)
        self.save()
        with open(md_path, "w") as f:
            f.write(markdown(r))
        summary(r)
        return 0 if r["all_bitwise_true"] and not r["errors"] else 1


def write_rows(path: str | None, rows: list) -> None:
    """A probe's result rows as JSON at ``path`` (nothing when no path was given)."""
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)


def fits(rows: list[dict]) -> list[dict]:
    """Per (page, batch) timed at two or more contexts, per implementation ``name`` (a ``name_us``
    key in every such row): the least-squares line time_us = fixed_us + us_per_GB * kv_bytes / 1e9
    over the contexts (``us_per_GB``, ``fixed_us``, ``points``)."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["page"], r["batch"]), []).append(r)
    res = []
    for (page, batch), rs in sorted(groups.items()):
        if len({r["kv_bytes"] for r in rs}) < 2:
            continue
        names = sorted(set.intersection(*({k[:-3] for k in r if k.endswith("_us")} for r in rs)))
        x = [r["kv_bytes"] / 1e9 for r in rs]
        mx = sum(x) / len(x)
        sxx = sum((a - mx) ** 2 for a in x)
        fit = {"page": page, "batch": batch, "contexts": [r["context"] for r in rs]}
        for name in names:
            y = [r[f"{name}_us"] for r in rs]
            my = sum(y) / len(y)
            slope = sum((a - mx) * (b - my) for a, b in zip(x, y)) / sxx
            fit[name] = {"us_per_GB": round(slope, 3), "fixed_us": round(my - slope * mx, 2), "points": len(y)}
        res.append(fit)
    return res


def add_row(path: str | None, rows: list, row: dict) -> None:
    """A probe's new result row: printed, appended to ``rows`` and every row so far written to
    ``path`` (so a run cut short keeps what it measured)."""
    print(row, flush=True)
    rows.append(row)
    write_rows(path, rows)


def rewrite_markdown(json_path: str, md_path: str, markdown, summary) -> int:
    """``--md-only``: the markdown table again from a saved report (no GPU needed)."""
    with open(json_path) as f:
        r = json.load(f)
    r.setdefault("out_path", json_path)
    with open(md_path, "w") as f:
        f.write(markdown(r))
    summary(r)
    return 0


def arguments(description: str) -> argparse.ArgumentParser:
    """The options every benchmark script takes (a script adds its own to the parser)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", required=True, help="JSON path")
    ap.add_argument("--md", required=True, help="markdown table path")
    ap.add_argument("--md-only", action="store_true", help="rewrite the markdown from an existing JSON")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, stand-in FA4: checks the script only")
    ap.add_argument("--sections", default="", help="comma-separated subset of the sections")
    return ap


def device_and_shapes(args, script: str, install_dry_run, dry_shapes, gpu_shapes):
    """``("cpu", dry_shapes)`` with the stand-ins installed for ``--dry-run``, else
    ``("cuda", gpu_shapes())``; exits with a message where there is no GPU."""
    if args.dry_run:
        install_dry_run()
        return "cpu", dry_shapes
    if not torch.cuda.is_available():
        sys.exit(f"{script} needs a CUDA GPU (--dry-run checks the script on a CPU)")
    return "cuda", gpu_shapes()


if __name__ == "__main__":
    if sys.argv[1:] == ["digest"]:
        print(source_digest())
    else:
        sys.exit("usage: python3 benchmarks/_report.py digest")
