"""Strict mode (the default) never falls back; non-strict falls back and records it."""
import pytest
import torch

import rlk_ops
from rlk_ops.meta import provenance


def _qkv():
    return torch.randn(1, 5, 4, 8), torch.randn(1, 5, 2, 8), torch.randn(1, 5, 2, 8)


def test_default_is_strict_and_records_provenance():
    assert rlk_ops.strict_mode()
    with provenance.capture() as log:
        rlk_ops.attention(*_qkv())
    (rec,) = log.records()
    assert (rec.op, rec.requested_backend, rec.actual_backend, rec.fallback, rec.calls) == (
        "attention_fwd", "cpu", "cpu", False, 1)


def test_strict_refuses_unavailable_backend():
    with rlk_ops.use_backend(attention_fwd="flashinfer"), provenance.capture() as log:
        with pytest.raises(rlk_ops.StrictModeError, match=r"rlk::attention_fwd on cpu: backend 'flashinfer' "
                                                          r"unavailable: .*Strict mode .* never falls back"):
            rlk_ops.attention(*_qkv())
    assert log.records() == []  # nothing ran


def test_non_strict_falls_back_and_records_why():
    q, k, v = _qkv()
    ref = rlk_ops.attention(q, k, v)
    with rlk_ops.strict(False), rlk_ops.use_backend(attention_fwd="flashinfer"), provenance.capture() as log:
        out = rlk_ops.attention(q, k, v)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    (rec,) = log.fallbacks()
    assert rec.requested_backend == "flashinfer" and rec.actual_backend == "cpu"
    assert "unavailable" in rec.fallback_reason
    assert rlk_ops.strict_mode()  # the context restored strictness


def test_unknown_backend_name_is_rejected():
    with pytest.raises(ValueError, match="unknown backend 'cudnn'"):
        with rlk_ops.use_backend(attention_fwd="cudnn"):
            pass


def test_environment_record():
    env = provenance.environment()
    assert env["torch"] == torch.__version__ and "gpu_arch" in env and "flash_attn_4" in env

