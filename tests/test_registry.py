"""The op registry is complete: every rlk op has a spec, a fake, an opcheck sample."""
import torch

import rlk_ops
from rlk_ops.meta.specs import REGISTRY

from samples import samples


def _defined_ops():
    return sorted(n.split("::")[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("rlk::"))


def test_every_defined_op_has_a_spec_and_vice_versa():
    assert _defined_ops() == sorted(REGISTRY)


def test_contract_ops_are_all_there():
    contract = {"qk_rmsnorm", "rope", "paged_kv_append", "paged_kv_gather", "attention_fwd", "attention_bwd",
                "paged_attention", "linear", "all_gather", "reduce_scatter"}
    assert contract <= set(REGISTRY)


def test_every_op_has_a_fake_and_cpu_kernel():
    from torch._library.simple_registry import singleton

    for name, spec in REGISTRY.items():
        assert singleton.find(spec.qualname).fake_impl.kernel is not None, name
        assert torch._C._dispatch_has_kernel_for_dispatch_key(spec.qualname, "CPU"), name
        assert torch._C._dispatch_has_kernel_for_dispatch_key(spec.qualname, "CUDA"), name


def test_every_op_has_an_opcheck_sample(single_process_group):
    assert sorted(samples(single_process_group.group_name)) == sorted(REGISTRY)


def test_specs_are_explicit():
    for name, spec in REGISTRY.items():
        op = getattr(torch.ops.rlk, name).default
        assert torch.Tag.pt2_compliant_tag in op.tags, name
        assert spec.backends, f"{name} has no backend spec"
        for backend, det in spec.backends.items():
            assert det.run_to_run is True, f"{name}/{backend}: strict ops are run-to-run deterministic"
        # nondeterministic_bitwise only on diagnostic lanes, and then as an op tag
        assert (torch.Tag.nondeterministic_bitwise in op.tags) == (not spec.deterministic), name
        for bwd in spec.backward:
            assert bwd in REGISTRY, f"{name}'s backward op {bwd} is not registered"
        assert spec.differentiable == bool(spec.backward), name
        assert set(spec.as_dict()) >= {"name", "qualname", "tags", "backends", "schema"}


def test_mutating_ops_declare_it():
    schema = torch.ops.rlk.paged_kv_append.default._schema
    mutated = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert tuple(mutated) == REGISTRY["paged_kv_append"].mutates


def test_public_api():
    for fn in ("attention", "paged_attention", "paged_kv_append", "paged_kv_gather", "qk_rmsnorm", "rope",
               "linear", "all_gather", "reduce_scatter"):
        assert callable(getattr(rlk_ops, fn))
    assert rlk_ops.strict_mode() is True  # the default
    assert callable(rlk_ops.value_checks) and issubclass(rlk_ops.ValueChecksInCapture, RuntimeError)
