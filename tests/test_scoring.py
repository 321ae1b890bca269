"""rlk_ops.rollout.scoring: packing rollouts for the trainer and the completion tokens' log-probs."""
import pytest
import torch

from rlk_ops.ops._validate import RlkInputError
from rlk_ops.rollout.engine import Request, RolloutEngine, Sampler, cache_for
from rlk_ops.rollout.model import TinyQwen3, TinyQwen3Config
from rlk_ops.rollout.scoring import PackedBatch, completion_logprobs, pack, split


def test_pack_lays_out_every_sequence_but_its_last_token():
    b = pack([[5, 6, 7, 8], [9, 10], torch.tensor([1, 2, 3])], [2, 2, 1])
    assert b.tokens.tolist() == [5, 6, 7, 9, 1, 2]
    assert b.positions.tolist() == [0, 1, 2, 0, 0, 1]
    assert b.cu_seqlens.tolist() == [0, 3, 4, 6] and b.cu_seqlens.dtype == torch.int32
    # rows predicting 7, 8 (sequence 0), none (sequence 1: all prompt), 2, 3 (sequence 2)
    assert b.rows.tolist() == [1, 2, 4, 5] and b.targets.tolist() == [7, 8, 2, 3]
    assert b.starts == (0, 3, 4) and b.completions == (2, 0, 2) and b.longest == 3
    parts = split(torch.arange(4.0), b)
    assert [p.tolist() for p in parts] == [[0.0, 1.0], [], [2.0, 3.0]]


def _model():
    return TinyQwen3(TinyQwen3Config(num_layers=2, hidden_size=64, intermediate_size=96, num_heads=4,
                                     num_kv_heads=2, head_dim=16, vocab_size=50), seed=3)


def test_completion_logprobs_are_the_rollouts_and_each_sequence_alone():
    model = _model()
    g = torch.Generator().manual_seed(0)
    requests = [Request(i, torch.randint(0, 50, (n,), generator=g).tolist(), m)
                for i, (n, m) in enumerate([(9, 5), (30, 3), (2, 7)])]
    results = RolloutEngine(model, cache_for(model, requests, 8, 3), max_running=3, chunk=8,
                            sampler=Sampler(1)).run(requests)
    batch = pack([r.tokens for r in results], [len(r.prompt) for r in results])
    logits = model.forward_train(batch.tokens, batch.positions, batch.cu_seqlens, batch.longest)
    logp = completion_logprobs(logits, batch)
    assert logp.requires_grad and logp.dtype == torch.float32
    assert torch.equal(logp.detach(), torch.tensor([lp for r in results for lp in r.logprobs]))
    for r, part in zip(results, split(logp.detach(), batch)):   # batch-invariant: each sequence alone
        alone = pack([r.tokens], [len(r.prompt)])
        one = model.forward_train(alone.tokens, alone.positions, alone.cu_seqlens, alone.longest)
        assert torch.equal(completion_logprobs(one, alone).detach(), part)
    (-logp.mean()).backward()
    assert model.lm_head.weight.grad is not None


@pytest.mark.parametrize("args, fragment", [
    (([], []), "sequences must be a non-empty list of token sequences, got list"),
    (("abc", [1]), "sequences must be a non-empty list of token sequences, got str"),
    (([[1, 2]], [1, 1]), "prompt_lengths must be a list of 1 ints (one per sequence), got 2"),
    (([[1, 2]], 1), "prompt_lengths must be a list of 1 ints (one per sequence), got int"),
    (([[1, 2, 3]], [0]), "prompt_lengths[0] must be an int in [1, 3] (sequence 0 has 3 tokens), got 0"),
    (([[1, 2, 3]], [4]), "prompt_lengths[0] must be an int in [1, 3] (sequence 0 has 3 tokens), got 4"),
    (([[1, 2, 3]], [True]), "prompt_lengths[0] must be an int in [1, 3]"),
    (([[1, 2.5]], [1]), "sequences[0] must be a list of token ids (ints), got list [1, 2.5]"),
    (([[1, True]], [1]), "sequences[0] must be a list of token ids (ints)"),
    (([torch.zeros(2, 2, dtype=torch.long)], [1]), "sequences[0] must be a 1-D int64 or int32 tensor"),
    (([[1], [2]], [1, 1]), "every sequence has a single token: nothing to forward"),
])
def test_bad_input_to_pack_is_named(args, fragment):
    with pytest.raises(RlkInputError) as e:
        pack(*args)
    assert fragment in str(e.value) and str(e.value).startswith("pack: ")


def test_bad_input_to_completion_logprobs_is_named():
    b = pack([[1, 2, 3]], [1])
    with pytest.raises(RlkInputError, match=r"logits must be \[2, vocab\] \(one row per packed token\), got \[3, 7\]"):
        completion_logprobs(torch.zeros(3, 7), b)
    with pytest.raises(RlkInputError, match="batch must be pack\\(\\)'s PackedBatch, got tuple"):
        completion_logprobs(torch.zeros(2, 7), (b.tokens,))
    assert isinstance(b, PackedBatch)


def test_a_tempered_rollout_records_the_tempered_log_probs():
    """A sampler at temperature T draws from softmax(logits / T): the engine records that distribution's
    log-probs, which the trainer's completion_logprobs(..., T) gives back bitwise; a custom logprobs function
    that cannot take the temperature is refused rather than recording another distribution's."""
    model = _model()
    g = torch.Generator().manual_seed(1)
    requests = [Request(i, torch.randint(0, 50, (n,), generator=g).tolist(), 6) for i, n in enumerate([4, 11])]
    results = RolloutEngine(model, cache_for(model, requests, 8, 2), sampler=Sampler(2, temperature=0.6)).run(requests)
    batch = pack([r.tokens for r in results], [len(r.prompt) for r in results])
    logits = model.forward_train(batch.tokens, batch.positions, batch.cu_seqlens, batch.longest)
    recorded = torch.tensor([lp for r in results for lp in r.logprobs])
    assert torch.equal(completion_logprobs(logits, batch, 0.6).detach(), recorded)
    assert not torch.equal(completion_logprobs(logits, batch).detach(), recorded)
    with pytest.raises(ValueError, match="logprobs must then take a temperature= argument"):
        RolloutEngine(model, cache_for(model, requests, 8, 2), sampler=Sampler(2, temperature=0.6),
                      logprobs=lambda x: x.float().log_softmax(-1))
