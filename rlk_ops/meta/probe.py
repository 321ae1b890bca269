"""What a side ran: side descriptions for the binding check, and the determinism
environment probe.

A side description (``describe_side``; ``describe_train`` / ``describe_rollout`` for a
model with TinyQwen3's two entry points) is evidence only. Each entry point is run
once through ``inspect_boundary`` (capturing AOT backend: the graphs run as captured)
inside ``provenance.capture()``, so the graph and the record of which backend
executed each op come from the same calls. The caller states what no graph shows:
the model identity (a weight hash by default) and the TP/CP topology.

Environment probe: the process-wide settings and versions that can change the bits a
side computes, and which of them matter for the path it ran.

``probe()`` reads them (no GPU needed; CUDA-only values are None without one).
``blocking(setting, path)`` says whether a setting changes arithmetic on a side's
path, and why: a blocking setting must be equal on both sides of a binding, the
rest are recorded. ``path`` is what the side's provenance and topology show: the
device types and backends that actually ran, and the tp/cp degrees.

Why each rule (the conservative choice where we cannot see inside a library):

* torch and rlk_ops versions, and the rlk_ops source digest: always. The CPU reference is built
  on ATen reductions (kernels/cpu/numerics.py), the graphs on Dynamo/AOT, the kernels on rlk_ops
  itself. The package version does not name the code (an editable install keeps one version over
  every commit), so ``source.rlk_ops`` hashes the package's Python sources as imported.
* cpu_capability: when the cpu backend ran. ATen's vectorised reductions use the
  vector width of the dispatched kernel (AVX2 / AVX512 / ...), which fixes the order
  of the partial sums the reference relies on.
* TF32 / reduced-precision reduction / cuDNN / deterministic-algorithms flags,
  CUBLAS_WORKSPACE_CONFIG, CUDA version, GPU architecture: when anything ran on a
  CUDA device. The rlk kernels pin their own controls, but the graph's non-rlk nodes
  (residual adds, embeddings, glue; BoundaryReport.leaks) run as ATen/Inductor/cuBLAS
  kernels that read these flags, and kernel choice depends on the architecture.
* NCCL_ALGO / NCCL_PROTO: on CUDA with tp * cp > 1. rlk collectives only move bytes
  and sum in rank order locally, but a TP/CP step may also reduce through NCCL outside
  them (e.g. a row-parallel all-reduce), where the algorithm fixes the sum order.
* flash_attn_4 + nvidia_cutlass_dsl / flashinfer / triton versions: when that
  backend ran (triton also on any CUDA run: Inductor generates Triton kernels).
* python: recorded only.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import sys
from dataclasses import asdict, dataclass

import torch

from rlk_ops.meta import packing, provenance

FORMAT = "rlk_ops.binding.side/1"


def _read(fn):
    try:
        return fn()
    except Exception as e:  # an API removed in some torch version: say so, do not guess
        return f"unreadable: {type(e).__name__}"


def tree_digest(root: str, tops: tuple[str, ...]) -> str:
    """sha256 (16 hex digits) over the Python files under ``root``/``top`` for each top: relative paths
    and contents, sorted (benchmarks/_report.py names its results' code with it too)."""
    files = sorted(os.path.join(d, f) for top in tops for d, _, fs in os.walk(os.path.join(root, top))
                   if "__pycache__" not in d for f in fs if f.endswith(".py"))
    h = hashlib.sha256()
    for path in files:
        h.update(os.path.relpath(path, root).encode() + b"\0")
        with open(path, "rb") as f:
            h.update(f.read() + b"\0")
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """``tree_digest`` of the rlk_ops package this process imported."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return tree_digest(os.path.dirname(package), (os.path.basename(package),))


def probe() -> dict:
    """The settings and versions of this process, as a flat JSON-able dict."""
    env = provenance.environment()
    matmul = torch.backends.cuda.matmul
    cudnn = torch.backends.cudnn
    out = {
        "torch.deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "torch.deterministic_algorithms_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        # read through _read: after the newer fp32_precision API is used, the legacy getter raises
        "torch.float32_matmul_precision": _read(torch.get_float32_matmul_precision),
        # oneDNN's fp32 precision on CPU (bf16/tf32 arithmetic for fp32 matmuls on AMX / avx512_bf16 CPUs)
        "backends.fp32_precision": _read(lambda: getattr(torch.backends, "fp32_precision", None)),
        "mkldnn.matmul.fp32_precision": _read(lambda: torch.backends.mkldnn.matmul.fp32_precision),
        "mkldnn.conv.fp32_precision": _read(lambda: torch.backends.mkldnn.conv.fp32_precision),
        "cuda.matmul.allow_tf32": _read(lambda: matmul.allow_tf32),
        "cuda.matmul.fp32_precision": _read(lambda: getattr(matmul, "fp32_precision", None)),
        "cuda.matmul.allow_bf16_reduced_precision_reduction":
            _read(lambda: matmul.allow_bf16_reduced_precision_reduction),
        "cuda.matmul.allow_fp16_reduced_precision_reduction":
            _read(lambda: matmul.allow_fp16_reduced_precision_reduction),
        "cudnn.allow_tf32": _read(lambda: cudnn.allow_tf32),
        "cudnn.deterministic": _read(lambda: cudnn.deterministic),
        "cudnn.benchmark": _read(lambda: cudnn.benchmark),
        "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "NCCL_ALGO": os.environ.get("NCCL_ALGO"),
        "NCCL_PROTO": os.environ.get("NCCL_PROTO"),
        "gpu_arch": env["gpu_arch"],
        "cuda": env["cuda"],
        "cpu_capability": env["cpu_capability"],
        "version.torch": env["torch"],
        "version.rlk_ops": env["rlk_ops"],
        "source.rlk_ops": source_digest(),
        "version.flash_attn_4": env["flash_attn_4"],
        "version.nvidia_cutlass_dsl": env["nvidia_cutlass_dsl"],
        "version.flashinfer": env["flashinfer"],
        "version.triton": env["triton"],
        "python": platform.python_version(),
    }
    return out


# settings that change fp32 matmuls on the CPU too: with float32_matmul_precision "medium", or oneDNN's
# fp32_precision "bf16", an fp32 matmul outside the rlk ops changed its bits on this project's CPU (AMX,
# avx512_bf16; a session 38 audit: it was taken for CUDA-only, so two CPU sides bound with other bits)
_CPU_AND_CUDA_SETTINGS = {"torch.float32_matmul_precision", "backends.fp32_precision"}
_CPU_SETTINGS = {"mkldnn.matmul.fp32_precision", "mkldnn.conv.fp32_precision"}   # oneDNN: read on the CPU only
_CUDA_SETTINGS = {
    "torch.deterministic_algorithms", "torch.deterministic_algorithms_warn_only",
    "cuda.matmul.allow_tf32", "cuda.matmul.fp32_precision", "cuda.matmul.allow_bf16_reduced_precision_reduction",
    "cuda.matmul.allow_fp16_reduced_precision_reduction", "cudnn.allow_tf32", "cudnn.deterministic",
    "cudnn.benchmark", "CUBLAS_WORKSPACE_CONFIG", "gpu_arch", "cuda",
}
_BACKEND_VERSIONS = {
    "version.flash_attn_4": ("fa4",), "version.nvidia_cutlass_dsl": ("fa4",), "version.flashinfer": ("flashinfer",),
    "version.triton": ("triton",),
}


def path_of(records: list[dict], tp: int = 1, cp: int = 1) -> dict:
    """What a side ran, from its provenance records (and its topology)."""
    return {
        "devices": sorted({str(r["device"]).split(":")[0] for r in records}),
        "backends": sorted({r["actual_backend"] for r in records}),
        "ranks": tp * cp,
    }


@functools.lru_cache(maxsize=1)
def probe_keys() -> tuple[str, ...]:
    """The keys ``probe`` writes (fixed; read once): what a binding judges, present in a file or not."""
    return tuple(probe())


def blocking(setting: str, path: dict) -> str | None:
    """Why ``setting`` changes arithmetic on ``path`` (None: it does not; recorded only)."""
    cuda = "cuda" in path["devices"]
    if setting in ("version.torch", "version.rlk_ops", "source.rlk_ops"):
        return "every path: ATen reductions, graph capture and the rlk kernels themselves"
    if setting == "cpu_capability":
        return "the cpu backend ran: ATen's vector width fixes its reduction order" \
            if "cpu" in path["backends"] else None
    if setting in _CPU_AND_CUDA_SETTINGS:
        return "fp32 matmuls of non-rlk graph nodes read it (oneDNN on CPU, cuBLAS on CUDA)"
    if setting in _CPU_SETTINGS:
        return "ran on CPU: fp32 matmuls of non-rlk graph nodes go through oneDNN, which reads it" \
            if "cpu" in path["devices"] else None
    if setting in _CUDA_SETTINGS:
        return "ran on CUDA: non-rlk graph nodes run ATen/cuBLAS/cuDNN kernels that read it" if cuda else None
    if setting in ("NCCL_ALGO", "NCCL_PROTO"):
        return "CUDA with tp*cp > 1: NCCL reductions outside the rlk collectives" \
            if cuda and path["ranks"] > 1 else None
    if setting in _BACKEND_VERSIONS:
        ran = [b for b in _BACKEND_VERSIONS[setting] if b in path["backends"]]
        if ran:
            return f"the {ran[0]} backend ran"
        if setting == "version.triton" and cuda:
            return "ran on CUDA: Inductor compiles the graph's non-rlk nodes to Triton"
        return None
    return None


# ------------------------------------------------------------ side descriptions
@dataclass(frozen=True)
class Topology:
    """Where this rank sits; taken as input (the distributed mesh is not read here).
    ``head_ownership``: the global head ranges this rank runs, ``{"q": [start, stop],
    "kv": [start, stop]}`` (None with tp == 1: every head). ``sequence_ownership``: which
    tokens it holds, e.g. ``"whole"`` (cp == 1) or ``{"mode": "zigzag", "chunks": 4, "rank": 0}``."""
    tp: int = 1
    cp: int = 1
    head_ownership: dict | None = None
    sequence_ownership: str | dict | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def weights_id(module: torch.nn.Module, packed: dict | None = None) -> str:
    """sha256 over every state_dict entry (name, dtype, shape, raw bytes), in name order.
    The dtype is part of it: the same checkpoint held in fp16 and bf16 is two sets of
    numbers (pass a checkpoint id to ``describe_*`` to bind those as one model). ``packed``
    (meta/packing.py): a fused parameter counts as its parts, by their names."""
    h = hashlib.sha256()
    for name, t in sorted(packing.state_items(module, packing.check(packed, module)), key=lambda x: x[0]):
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():  # raw bytes without numpy (the package depends on torch only)
            h.update(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()))
    return "sha256:" + h.hexdigest()


def _plan_logs() -> dict:
    """Per-call split plans of backends that plan at run time (today: FlashInfer's
    ``plan_log()``), as {key: (record, calls)}; only backends already imported."""
    module = sys.modules.get("rlk_ops.kernels.flashinfer")
    if module is None:
        return {}
    return {tuple(sorted((k, str(v)) for k, v in r.items() if k != "calls")): (r, r["calls"])
            for r in module.plan_log().records()}


def flashinfer_plans(records: list[dict]) -> list[dict]:
    """FlashInfer plan records -> binding plan records {op, backend, policy, plan}."""
    out = []
    for r in records:
        if "split_kv" not in r:
            plan = f"unknown ({r.get('plan_info_error', 'no split_kv in the plan record')})"
        else:
            plan = f"chunks:{r['kv_chunk_tokens']}" if r["split_kv"] else "single_pass"
        op = "paged_attention_auto" if r["policy"] == "auto" else "paged_attention"
        out.append({"op": op, "backend": "flashinfer", "policy": r["policy"], "plan": plan})
    return out


def run_entry(name: str, fn, *args, backward: bool = False, roles: dict | None = None, packed: dict | None = None,
              **kwargs) -> dict:
    """Compile ``fn`` with the capturing backend, run it on ``args`` (and one backward
    when asked), and return the entry's evidence: graph, provenance, plan records, and
    the strict mode it ran under. The same call also runs eagerly first, on copies of the
    arguments: the graph counts as the entry's computation only if its outputs (and, with backward,
    the parameters' gradients) are bitwise that run's (``graph.eager_equal``: an engine that runs the
    entry eagerly runs what was bound). ``roles``: {role: tensor argument} named alike on both sides
    (``inspect_boundary``): the describe functions name tokens, positions and the sequence metadata.
    ``packed``: fused parameters named as their parts (meta/packing.py)."""
    from rlk_ops.compile.boundary import eager_outputs, inspect_boundary
    from rlk_ops.kernels.dispatch import strict_mode

    eager = eager_outputs(fn, args, kwargs, backward=backward)   # before the capture: not the entry's evidence
    before = _plan_logs()
    with provenance.capture() as log:
        report = inspect_boundary(fn, *args, backward=backward, eager=eager, roles=roles, packed=packed, **kwargs)
    plans = [r for k, (r, calls) in _plan_logs().items() if calls > before.get(k, (None, 0))[1]]
    graph = {"forward": [asdict(n) for n in report.forward], "backward": [asdict(n) for n in report.backward],
             "graphs": report.graphs, "graph_breaks": report.graph_breaks, "recompiles": report.recompiles,
             "leaks": [leak.target for leak in report.leaks], "graph_runs": report.graph_runs,
             "outside_calls": report.outside_calls, "eager_equal": report.eager_equal,
             "eager_note": report.eager_note, "output_maps": report.output_maps, "outputs_note": report.outputs_note,
             "write_maps": report.write_maps, "output_structure": report.output_structure}
    return {"name": name, "graph": graph, "provenance": log.snapshot(), "plans": flashinfer_plans(plans),
            "strict": strict_mode()}


def describe_side(side: str, entries: list[dict], *, model_id: str, model_id_kind: str = "given",
                  topology: Topology | None = None, compiled: bool = False, packed: dict | None = None) -> dict:
    """A side description from executed entries (``run_entry``). ``compiled``: whether
    this side's production path runs under torch.compile (recorded only). ``packed``: the packing the
    entries and the model id read the parameters with (recorded as ``model.packed``). ``runtime.strict``
    is the mode the entries ran under (entries that ran under different modes are refused);
    with no entries, the mode now (a configured side)."""
    from rlk_ops.kernels.dispatch import strict_mode

    plans = [p for e in entries for p in e.get("plans", [])]
    modes = {e["name"]: e["strict"] for e in entries if "strict" in e}
    if len(set(modes.values())) > 1:
        raise ValueError(f"describe_side: the entries ran under different strict modes, got {modes}")
    strict = next(iter(modes.values())) if modes else strict_mode()
    return {
        "format": FORMAT, "side": side,
        "model": {"id": model_id, "kind": model_id_kind,
                  **({"packed": {k: [list(p) for p in v] for k, v in packed.items()}} if packed else {})},
        "topology": (topology or Topology()).as_dict(),
        "runtime": {"compiled": compiled, "strict": strict},
        "entries": [{k: v for k, v in e.items() if k != "plans"} for e in entries],
        "plans": plans,
        "environment": probe(),
    }


def _identity(model, model_id: str | None, packed: dict | None = None) -> dict:
    if model_id is not None and (not isinstance(model_id, str) or not model_id.strip()):
        # '' once fell back to the weights' sha256 silently (a session 34 audit)
        raise ValueError(f"model_id must be a non-empty string (a checkpoint id) or None (the weights' "
                         f"sha256), got {type(model_id).__name__} {model_id!r}")
    return {"model_id": model_id, "model_id_kind": "given"} if model_id is not None else \
        {"model_id": weights_id(model, packed), "model_id_kind": "weights_sha256"}


def describe_train(model, *, lengths=(5, 3), backward: bool = True, model_id: str | None = None,
                   topology: Topology | None = None, compiled: bool = False, packed: dict | None = None) -> dict:
    """The training side of a model with ``forward_train(tokens, positions, cu_seqlens,
    max_seqlen)``: one packed varlen batch (forward, and backward when asked; the
    gradients it leaves are cleared). ``packed``: fused parameters and their parts (meta/packing.py)."""
    packed = packing.check(packed, model)
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model.config.vocab_size, (sum(lengths),), generator=g).to(device)
    positions = torch.cat([torch.arange(n) for n in lengths]).to(device)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    entry = run_entry("train", model.forward_train, tokens, positions, cu, max(lengths), backward=backward,
                      roles={"tokens": tokens, "positions": positions, "cu_seqlens": cu}, packed=packed)
    model.zero_grad(set_to_none=True)
    return describe_side("train", [entry], topology=topology, compiled=compiled, packed=packed,
                         **_identity(model, model_id, packed))


def describe_rollout(model, *, page_size: int = 16, prompt: int = 5, batch: int = 2,
                     entries=("prefill", "decode"), model_id: str | None = None,
                     topology: Topology | None = None, compiled: bool = False, forward=None,
                     packed: dict | None = None) -> dict:
    """The rollout side of a model with ``forward_rollout(tokens, positions, cache, seqs,
    slot_mapping)``: a chunked prefill of ``prompt`` tokens for ``batch`` sequences and/or
    one batched decode step, each its own entry (graph + provenance). A decode-only side
    still reserves the prompt's slots (their cache rows stay zero: valid keys).
    ``forward(model, ...)``: another rollout forward with that signature (e.g. the plain
    PyTorch negative control, rollout/plain.py). ``packed``: fused parameters and their parts, vLLM's
    ``qkv_proj`` and ``gate_up_proj`` (meta/packing.py)."""
    from rlk_ops.ops._validate import positive_ints
    from rlk_ops.rollout.cache import PagedKVCache

    positive_ints("describe_rollout", page_size=page_size, prompt=prompt, batch=batch)
    packed = packing.check(packed, model)
    fn = model.forward_rollout if forward is None else functools.partial(forward, model)
    cfg = model.config
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    pages = batch * (-(-(prompt + 1) // page_size)) + 2
    cache = PagedKVCache(cfg.num_layers, pages, page_size, cfg.num_kv_heads, cfg.head_dim, dtype=dtype,
                         device=device, seed=1)
    seqs = list(range(batch))
    g = torch.Generator().manual_seed(2)
    done = []
    with torch.no_grad():
        for s in seqs:
            cache.add(s)
        slots = torch.cat([cache.reserve(s, prompt) for s in seqs])
        if "prefill" in entries:
            tokens = torch.randint(0, cfg.vocab_size, (batch, prompt), generator=g).to(device)
            positions = torch.arange(prompt).expand(batch, prompt).contiguous().to(device)
            done.append(run_entry("prefill", fn, tokens, positions, cache, seqs, slots,
                                  roles={"tokens": tokens, "positions": positions, "slot_mapping": slots},
                                  packed=packed))
        if "decode" in entries:
            slots = torch.cat([cache.reserve(s, 1) for s in seqs])
            tokens = torch.randint(0, cfg.vocab_size, (batch, 1), generator=g).to(device)
            positions = torch.full((batch, 1), prompt, dtype=torch.int64, device=device)
            done.append(run_entry("decode", fn, tokens, positions, cache, seqs, slots,
                                  roles={"tokens": tokens, "positions": positions, "slot_mapping": slots},
                                  packed=packed))
    return describe_side("rollout", done, topology=topology, compiled=compiled, packed=packed,
                         **_identity(model, model_id, packed))
