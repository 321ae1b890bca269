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
