"""Determinism specs: one registry of every ``rlk`` op, what it guarantees on each
backend, and its tags. Tests enumerate it, so an op that is defined without a spec
(or a spec without an op, fake or opcheck sample) fails the suite.

The four properties (each a tested, bitwise claim; see README "What deterministic
means here"):

* ``run_to_run``      same inputs, same bits, every call.
* ``batch_invariant`` a row's output does not depend on batch size, batch
                      composition, padding or which physical pages hold its KV.
* ``prefill_decode_invariant`` (attention) query row i gets the same bits in full
                      prefill, chunked prefill at any offset, and paged decode.
* ``world_size_invariant`` (collectives and sharded ops) the result does not depend
                      on how many ranks share the work.

``None`` means "not applicable to this op".
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch


@dataclass(frozen=True)
class DeterminismSpec:
    run_to_run: bool
    batch_invariant: bool | None
    prefill_decode_invariant: bool | None = None
    world_size_invariant: bool | None = None
    notes: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class OpSpec:
    name: str
    stage: str
    schema: str
    mutates: tuple[str, ...] = ()
    differentiable: bool = False
    backward: tuple[str, ...] = ()  # ops the backward of this op calls
    backends: dict[str, DeterminismSpec] = field(default_factory=dict)
    extra_tags: tuple[torch.Tag, ...] = ()

    @property
    def qualname(self) -> str:
        return f"rlk::{self.name}"

    @property
    def tags(self) -> tuple[torch.Tag, ...]:
        return (torch.Tag.pt2_compliant_tag, *self.extra_tags)

    @property
    def deterministic(self) -> bool:
        return torch.Tag.nondeterministic_bitwise not in self.extra_tags

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "qualname": self.qualname,
            "stage": self.stage,
            "schema": self.schema,
            "mutates": list(self.mutates),
            "differentiable": self.differentiable,
            "backward": list(self.backward),
            "tags": [str(t).split(".")[-1] for t in self.tags],
            "backends": {k: v.as_dict() for k, v in self.backends.items()},
        }


# The CPU reference backend: everything is by construction (kernels/cpu/numerics.py).
_CPU_ROW = DeterminismSpec(True, True, notes="per-row fixed-order reductions (kernels/cpu/numerics.py)")
_CPU_ATTN = DeterminismSpec(
    True, True, True,
    notes="online softmax over 128-key blocks aligned to absolute position 0, ascending, fp32; "
          "canonical:C: one such pass per C-key chunk, states merged by rlk::merge_attn_states",
)
_CPU_COPY = DeterminismSpec(True, True, notes="pure data movement")
_CPU_GRAD = DeterminismSpec(
    True, None,
    notes="sums over tokens in a fixed order for a given batch; the batch is an input of a gradient",
)
_C10D_AG = DeterminismSpec(True, True, world_size_invariant=True,
                           notes="moves bytes only: exact; verified over gloo (tests/test_collectives.py), "
                                 "NCCL not yet run (multi-GPU machines withheld)")
_C10D_RS = DeterminismSpec(
    True, True, world_size_invariant=False,
    notes="all_to_all, then an fp32 sum in ascending rank order; the order depends on the world size; verified "
          "over gloo (tests/test_collectives.py, rows alone and in batches), NCCL not yet run",
)

# triton (kernels/triton/) and flashinfer (kernels/flashinfer.py): verified on sm90 (H200,
# triton 3.6, flashinfer 0.7.2.post1) by tests/test_triton.py, tests/test_flashinfer.py and
# benchmarks/kernel_bench.py (results/h200/kernels.json). Not bitwise equal to the cpu reference
# (other summation orders); the drift is reported there.
_TRITON_ROW = DeterminismSpec(
    True, True, notes="verified on sm90: a row's reduction order is fixed by head_dim, dtype and num_warps; "
                      "rows computed in a batch equal the rows alone")
_TRITON_COPY = DeterminismSpec(True, True, notes="pure data movement; equal to the cpu reference (verified on sm90)")
_TRITON_GRAD = DeterminismSpec(
    True, None, notes="sums over tokens in fixed-size chunks, partials added in ascending order, no atomics "
                      "(run-to-run verified on sm90)")

REGISTRY: dict[str, OpSpec] = {}


def _add(spec: OpSpec) -> None:
    REGISTRY[spec.name] = spec


_add(OpSpec("qk_rmsnorm", "norm", "(Tensor x, Tensor weight, float eps) -> Tensor",
            differentiable=True, backward=("qk_rmsnorm_bwd",), backends={"cpu": _CPU_ROW, "triton": _TRITON_ROW}))
_add(OpSpec("qk_rmsnorm_bwd", "norm", "(Tensor dy, Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)",
            backends={"cpu": _CPU_GRAD, "triton": _TRITON_GRAD}))
_add(OpSpec("rope", "rope", "(Tensor x, Tensor positions, float theta, int rotary_dim) -> Tensor",
            differentiable=True, backward=("rope_bwd",), backends={"cpu": _CPU_ROW, "triton": _TRITON_ROW}))
_add(OpSpec("rope_bwd", "rope", "(Tensor dy, Tensor positions, float theta, int rotary_dim) -> Tensor",
            backends={"cpu": _CPU_ROW,
                      "triton": DeterminismSpec(True, True, notes="the rope kernel with the inverse rotation, "
                                                                  "elementwise per row; run to run and B=1 vs "
                                                                  "batch in tests/test_triton.py (cuda)")}))
_add(OpSpec("qk_norm_rope", "norm_rope",
            "(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, Tensor positions, float eps, float theta, "
            "int rotary_dim) -> (Tensor, Tensor)",
            differentiable=True, backward=("rope_bwd", "qk_rmsnorm_bwd"),
            backends={"cpu": DeterminismSpec(True, True, notes="qk_rmsnorm then rope (bitwise, by construction)"),
                      "triton": DeterminismSpec(True, True, notes="verified on sm90: bitwise equal to the triton "
                                                                  "qk_rmsnorm then rope")}))
_add(OpSpec("paged_kv_append", "kv_cache",
            "(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slot_mapping, "
            "Tensor? page_table=None, Tensor? seq_lens=None, Tensor? positions=None) -> ()",
            mutates=("k_cache", "v_cache"), backends={"cpu": _CPU_COPY, "triton": _TRITON_COPY}))
_add(OpSpec("paged_kv_gather", "kv_cache",
            "(Tensor k_cache, Tensor v_cache, Tensor page_table, Tensor seq_lens) -> (Tensor, Tensor)",
            backends={"cpu": _CPU_COPY, "triton": _TRITON_COPY}))
_ATTN_ARGS = ("int causal, float softmax_scale, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, "
              "SymInt max_seqlen_q, SymInt max_seqlen_k, str split_kv")
# fa4 (flash_attn.cute, kernels/fa4/): verified on sm90 (H200) with flash-attn-4 4.0.0b36 by
# benchmarks/attention.py (results/h200/attention.json); other architectures are recorded as unverified.
_FA4_ATTN = DeterminismSpec(
    True, True, True,
    notes="verified on sm90: num_splits=1, pack_gqa=True; 128x128 tiles, key blocks visited last to first "
          "(not the cpu order: the two backends agree to rounding, not bitwise)",
)
_FA4_PAGED = DeterminismSpec(
    True, True, True,
    notes="verified on sm90: num_splits=1, pack_gqa=True; decode (one query token, G = 4, head_dim 128) "
          "with 64x128 tiles, bitwise equal to the 128x128 tiles of the training forward; key blocks "
          "visited last to first; canonical:C decode at G = 1, 2, 4, 5, 8 (pages 16 and 128; G = 4 also "
          "256) runs the (chunk, sequence) pairs on the Triton pair kernel (kernels/triton/pair_decode.py), "
          "bitwise equal to FA4's pair call, then the merge",
)
_add(OpSpec("attention_fwd", "attention", f"(Tensor q, Tensor k, Tensor v, {_ATTN_ARGS}) -> (Tensor, Tensor)",
            differentiable=True, backward=("attention_bwd",), backends={"cpu": _CPU_ATTN, "fa4": _FA4_ATTN}))
_add(OpSpec("attention_bwd", "attention",
            f"(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse, {_ATTN_ARGS})"
            " -> (Tensor, Tensor, Tensor)",
            backends={"cpu": DeterminismSpec(True, None, notes="dq per row; dk/dv sum over query rows in a fixed order"),
                      "fa4": DeterminismSpec(True, None, notes="verified on sm90: deterministic=True (semaphore-"
                                                               "ordered dq/dk/dv accumulation); dlse folded exactly")}))
_add(OpSpec("paged_attention", "attention",
            "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor page_table, Tensor seq_lens, float softmax_scale, "
            "str split_kv)"
            " -> (Tensor, Tensor)",
            backends={"cpu": _CPU_ATTN, "fa4": _FA4_PAGED,
                      "flashinfer": DeterminismSpec(
                          True, True, False,
                          notes="split_kv disabled or fixed:N, tensor-core decode; verified on sm90: a sequence "
                                "alone equals it in a batch of 8 (Sq 1 and 4); not attention_fwd's bits")}))
# canonical:C split-KV merges chunk states with this op on both sides (kernels/cpu/merge.py).
_add(OpSpec("merge_attn_states", "attention", "(Tensor out_parts, Tensor lse_parts) -> (Tensor, Tensor)",
            differentiable=True, backward=("merge_attn_states_bwd",),
            backends={"cpu": DeterminismSpec(True, True, notes="states in ascending order, skipping lse = -inf; "
                                                               "fp32 elementwise, numerics.exp/log"),
                      "triton": DeterminismSpec(True, True, notes="verified on sm90: bitwise equal to the cpu "
                                                                  "merge (same IEEE steps, no FMA, div_rn), rows "
                                                                  "alone equal rows in a batch, run to run "
                                                                  "(results/h200/canonical.json)")}))
_add(OpSpec("merge_attn_states_bwd", "attention",
            "(Tensor dout, Tensor? dlse, Tensor out_parts, Tensor lse_parts, Tensor out, Tensor lse)"
            " -> (Tensor, Tensor)",
            backends={"cpu": DeterminismSpec(True, True, notes="per row: elementwise and one rowsum over head_dim"),
                      "triton": DeterminismSpec(True, True, notes="verified on sm90: per row, rowsum over a fixed "
                                                                  "[16, D] tile; run to run and rows alone == rows "
                                                                  "in a batch (not the cpu summation order)")}))
# The diagnostic lane whose split-KV the backend picks from the batch: tagged, refused in strict mode.
# The tag marks the diagnostic lanes (DESIGN.md): a sequence's bits depend on the batch it ran in, so
# a rerun in another batch differs; each backend's spec says what holds (run to run for a fixed batch).
_add(OpSpec("paged_attention_auto", "attention",
            "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor page_table, Tensor seq_lens, float softmax_scale)"
            " -> (Tensor, Tensor)",
            backends={"cpu": DeterminismSpec(True, True, True, notes="the cpu backend never splits: its "
                                                                     "automatic choice is one pass"),
                      "flashinfer": DeterminismSpec(True, False, False,
                                                    notes="FlashInfer's automatic split-KV: run-to-run for a "
                                                          "fixed batch; alone vs in a batch of 8 differ (sm90)")},
            extra_tags=(torch.Tag.nondeterministic_bitwise,)))
_add(OpSpec("linear", "projection", "(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
            differentiable=True, backward=("linear_bwd", "linear_bias_bwd"),
            backends={"cpu": _CPU_ROW,
                      "triton": DeterminismSpec(True, True, notes="verified on sm90: fixed 64x128x64 tiles, no "
                                                                  "split-K; rows at M=1/16/256 equal M=4096")}))
_add(OpSpec("linear_bwd", "projection", "(Tensor dy, Tensor x, Tensor weight) -> (Tensor, Tensor)",
            backends={"cpu": _CPU_GRAD, "triton": _TRITON_GRAD}))
_add(OpSpec("linear_bias_bwd", "projection", "(Tensor dy) -> Tensor",
            backends={"cpu": _CPU_GRAD, "triton": _TRITON_GRAD}))
_add(OpSpec("all_gather", "collective", "(Tensor x, int dim, str group_name) -> Tensor",
            differentiable=True, backward=("reduce_scatter",), backends={"c10d": _C10D_AG}))
_add(OpSpec("reduce_scatter", "collective", "(Tensor x, int dim, str group_name) -> Tensor",
            differentiable=True, backward=("all_gather",), backends={"c10d": _C10D_RS}))


def spec(name: str) -> OpSpec:
    try:
        return REGISTRY[name.removeprefix("rlk::").split(".")[0]]
    except KeyError:
        raise KeyError(f"no rlk op named {name!r}; known: {sorted(REGISTRY)}") from None


def all_specs() -> list[OpSpec]:
    return list(REGISTRY.values())
