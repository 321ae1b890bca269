"""torch.library.opcheck (schema, autograd registration, fake tensor, AOT dispatch
dynamic) for every rlk op on its sample inputs."""
import pytest
import torch

import rlk_ops
from rlk_ops.meta.specs import REGISTRY

from samples import DIFFERENTIABLE, NON_STRICT, samples


def _cases():
    for name in sorted(REGISTRY):
        yield name


@pytest.mark.parametrize("name", list(_cases()))
def test_opcheck(name, single_process_group):
    op = getattr(torch.ops.rlk, name).default
    for i, args in enumerate(samples(single_process_group.group_name)[name]):
        if name in DIFFERENTIABLE:
            args = tuple(a.clone().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                         for a in args)
        with rlk_ops.strict(name not in NON_STRICT):  # diagnostic lanes refuse strict mode
            torch.library.opcheck(op, args)  # all four default checks


@pytest.mark.parametrize("name", list(_cases()))
def test_every_op_refuses_forward_ad_and_a_gradient_it_has_no_formula_for(name, single_process_group):
    """Every op raises inside a forward-AD level (a JVP came back as 0; session 38), and every functional op
    without a derivative raises when a gradient reaches it (PyTorch's fallback only warned; session 39)."""
    import torch.autograd.forward_ad as fwad

    spec = REGISTRY[name]
    op = getattr(torch.ops.rlk, name).default
    args = samples(single_process_group.group_name)[name][0]
    with rlk_ops.strict(name not in NON_STRICT), fwad.dual_level():
        with pytest.raises(RuntimeError, match=rf"rlk::{name} has no forward-mode AD formula"):
            op(*args)
    if spec.differentiable or spec.mutates:
        return
    args = tuple(a.clone().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                 for a in args)
    with rlk_ops.strict(name not in NON_STRICT):
        out = op(*args)
    outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if o.requires_grad]
    assert outs, f"{name}: no output requires grad, so no backward could reach the op"
    with pytest.raises(RuntimeError, match=rf"rlk::{name} has no derivative, so no gradient can pass through it"):
        sum(o.float().sum() for o in outs).backward()
