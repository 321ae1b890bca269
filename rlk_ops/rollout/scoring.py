"""The trainer's side of a rollout: the log-probs of each completion, from one packed forward.

    batch = pack(sequences, prompt_lengths, device)           # prompt + completion token ids per sequence
    logits = hf_logits(model, batch.tokens, batch.positions, batch.cu_seqlens)   # or any packed forward
    logp = completion_logprobs(logits, batch)                 # [completion tokens], differentiable

``pack`` lays every sequence but its last token end to end (padding-free: the rollout never fed the last
token back, and no row predicts past it), with each sequence's positions from 0 and ``cu_seqlens``.
``completion_logprobs`` takes the rows that predict each completion token and returns their log-probs
through ``token_logprobs``: the rollout engine's bits, so with a forward that is the rollout's (rlk ops,
the same weights) they equal the rollout's log-probs bitwise, and a loss can read them directly (an
on-policy importance ratio of exactly 1).
"""
from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rlk_ops.ops._validate import RlkInputError
from rlk_ops.rollout.model import token_logprobs


@dataclass(frozen=True)
class PackedBatch:
    tokens: torch.Tensor        # [T] int64: each sequence but its last token, end to end
    positions: torch.Tensor     # [T] int64: 0.. within each sequence
    cu_seqlens: torch.Tensor    # [B + 1] int32
    rows: torch.Tensor          # [N] int64: the rows of the forward's logits that predict the completion tokens
    targets: torch.Tensor       # [N] int64: the completion tokens, in sequence order
    starts: tuple[int, ...]     # each sequence's first row
    completions: tuple[int, ...]   # each sequence's number of completion tokens
    longest: int                # the longest packed sequence


def _ids(where: str, i: int, seq) -> list[int]:
    if isinstance(seq, torch.Tensor):
        if seq.dim() != 1 or seq.dtype not in (torch.int64, torch.int32):
            raise RlkInputError(f"{where}: sequences[{i}] must be a 1-D int64 or int32 tensor or a list of ints, got "
                                f"{seq.dtype} of shape {list(seq.shape)}")
        return seq.tolist()
    if not isinstance(seq, Sequence) or not all(isinstance(t, numbers.Integral) and not isinstance(t, bool)
                                               for t in seq):
        raise RlkInputError(f"{where}: sequences[{i}] must be a list of token ids (ints), got "
                            f"{type(seq).__name__} {str(seq)[:80]}")
    return [int(t) for t in seq]


def pack(sequences, prompt_lengths, device="cpu") -> PackedBatch:
    """sequences: per sequence, its prompt then its completion (token ids); prompt_lengths: per sequence, how
    many of its tokens are prompt (at least 1: the first token has no row predicting it; at most the
    sequence's length: a sequence without completion tokens adds no row to score)."""
    where = "pack"
    if not isinstance(sequences, Sequence) or isinstance(sequences, (str, bytes)) or not len(sequences):
        raise RlkInputError(f"{where}: sequences must be a non-empty list of token sequences, got "
                            f"{type(sequences).__name__}")
    if not isinstance(prompt_lengths, Sequence) or len(prompt_lengths) != len(sequences):
        got = len(prompt_lengths) if isinstance(prompt_lengths, Sequence) else type(prompt_lengths).__name__
        raise RlkInputError(f"{where}: prompt_lengths must be a list of {len(sequences)} ints (one per sequence), "
                            f"got {got}")
    seqs = [_ids(where, i, s) for i, s in enumerate(sequences)]
    tokens, positions, cu, rows, targets, starts = [], [], [0], [], [], []
    for i, (seq, p) in enumerate(zip(seqs, prompt_lengths)):
        if not isinstance(p, numbers.Integral) or isinstance(p, bool) or not 1 <= p <= len(seq):
            raise RlkInputError(f"{where}: prompt_lengths[{i}] must be an int in [1, {len(seq)}] (sequence {i} has "
                                f"{len(seq)} tokens), got {p!r}")
        start = cu[-1]
        starts.append(start)
        body = seq[:-1]
        tokens += body
        positions += range(len(body))
        cu.append(start + len(body))
        rows += range(start + p - 1, start + len(seq) - 1)
        targets += seq[p:]
    if not tokens:
        raise RlkInputError(f"{where}: every sequence has a single token: nothing to forward")
    return PackedBatch(
        tokens=torch.tensor(tokens, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device),
        rows=torch.tensor(rows, dtype=torch.int64, device=device),
        targets=torch.tensor(targets, dtype=torch.int64, device=device),
        starts=tuple(starts), completions=tuple(len(s) - p for s, p in zip(seqs, prompt_lengths)),
        longest=max(b - a for a, b in zip(cu, cu[1:])))


def completion_logprobs(logits: torch.Tensor, batch: PackedBatch, temperature: float = 1.0) -> torch.Tensor:
    """logits [T, vocab] of the packed forward over ``batch`` -> the completion tokens' log-probs [N] (fp32, on
    logits' device, in sequence order), differentiable (``token_logprobs``); ``temperature``: the rollout
    sampler's, whose recorded log-probs are softmax(logits / T)'s."""
    if not isinstance(batch, PackedBatch):
        raise RlkInputError(f"completion_logprobs: batch must be pack()'s PackedBatch, got {type(batch).__name__}")
    t = batch.tokens.shape[0]
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[0] != t:
        got = list(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise RlkInputError(f"completion_logprobs: logits must be [{t}, vocab] (one row per packed token), got {got}")
    return token_logprobs(logits[batch.rows.to(logits.device)], batch.targets.to(logits.device), temperature)


def split(values: torch.Tensor, batch: PackedBatch) -> list[torch.Tensor]:
    """``completion_logprobs``' result [N] cut per sequence."""
    return list(values.split(list(batch.completions)))
