"""The rollout loop: chunked prefill, then decode with continuous batching.

Each step: admit waiting requests, in order, while fewer than ``max_running`` run and the
cache has the pages the next one needs to its end beside what the running ones still need; every
running sequence still in its prompt prefills one chunk (``chunk`` tokens, alone:
B=1); every sequence past its prompt decodes one token, all together (B = number of
decoding sequences, which changes as sequences finish and join). A finished
sequence releases its pages at once, so a waiting one can take them.

Tokens are chosen greedily or by a seeded Gumbel-max sampler keyed by (sequence,
position), so the choice never depends on the batch. With a temperature T the sampler draws from
softmax(logits / T), and the recorded log-probs are that distribution's (``log_softmax(logits, T)``;
a trainer's ``token_logprobs(logits, tokens, T)`` gives the same bits). A sequence ends at ``max_new_tokens`` or
when it generates one of its request's ``stop_tokens`` (an end-of-sequence id; kept as its last
token, with its log-prob; ``finish_reason`` says which). With ``forced`` tokens a request
replays given tokens instead (used to score the negative control on the same tokens; stop
tokens do not end a replay).
"""
from __future__ import annotations

import hashlib
import inspect
import math
import numbers
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rlk_ops.ops._validate import positive_ints, short_repr
from rlk_ops.rollout.cache import CacheFullError, PagedKVCache
from rlk_ops.rollout.model import Trace, check_temperature, k_weight, log_softmax


@dataclass
class Request:
    seq_id: int
    prompt: list[int]
    max_new_tokens: int
    forced: list[int] | None = None
    stop_tokens: list[int] | tuple[int, ...] = ()   # generating one of these ends the sequence (it is kept)


@dataclass
class SeqResult:
    seq_id: int
    prompt: list[int]
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    attn: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # position -> per-layer [Hq, D]
    lse: dict[int, list[torch.Tensor]] = field(default_factory=dict)   # position -> per-layer [Hq]
    admitted_step: int = -1
    finished_step: int = -1
    finish_reason: str = ""   # "stop" (a stop token was generated) or "length" (max_new_tokens reached)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated


class Sampler:
    """Greedy (``seed=None``) or Gumbel-max with noise drawn from a generator seeded by
    (seed, sequence, position): the same choice whatever else is in the batch."""

    def __init__(self, seed: int | None = 0, temperature: float = 1.0):
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2 ** 32):
            raise ValueError(f"Sampler seed must be None (greedy) or an int in [0, 2**32), got {seed!r}")
        self.seed, self.temperature = seed, check_temperature("Sampler ", temperature)

    def __call__(self, seq_id: int, position: int, logp: torch.Tensor) -> int:
        if self.seed is None:
            return int(logp.argmax())
        g = torch.Generator().manual_seed(noise_seed(self.seed, seq_id, position))
        u = torch.rand(logp.shape, generator=g, dtype=torch.float64).clamp_min(1e-300)
        gumbel = -torch.log(-torch.log(u))
        score = logp.double() / self.temperature + gumbel
        if score.max() == -math.inf and bool(torch.isfinite(logp).any()):
            # a tiny T overflowed logp / T to -inf in every entry (1e-310 then always picked token 0):
            # the same argmax scaled by T, where T * gumbel cannot overflow (|gumbel| < 40). Only
            # here: elsewhere the scores keep their bits, so no sampled token changes
            score = logp.double() + self.temperature * gumbel
        return int(score.argmax())


@dataclass
class StepLog:
    step: int
    prefill: list[tuple[int, int, int]]  # (seq, start, stop)
    decode: list[int]                     # seqs decoded together
    admitted: list[int]
    finished: list[int]


class RolloutEngine:
    def __init__(self, model, cache: PagedKVCache, *, max_running: int = 4, chunk: int = 96,
                 sampler: Sampler | None = None, forward: Callable | None = None,
                 logprobs: Callable | None = None, on_token: Callable[[int], None] | None = None):
        positive_ints("RolloutEngine", chunk=chunk, max_running=max_running)
        if not isinstance(cache, PagedKVCache):
            raise ValueError(f"RolloutEngine: cache must be a PagedKVCache, got {type(cache).__name__}")
        for name, fn in (("sampler", sampler), ("forward", forward), ("logprobs", logprobs), ("on_token", on_token)):
            if fn is not None and not callable(fn):   # else it failed after the first forward, unnamed
                raise ValueError(f"RolloutEngine: {name} must be callable or None, got {type(fn).__name__} {fn!r}")
        if forward is None and not callable(getattr(type(model), "forward_rollout", None)):
            wrapped = type(model).__name__ == "OptimizedModule"   # (no dynamo import for the check)
            raise ValueError(
                f"RolloutEngine: model must have a forward_rollout method (or pass forward=), got "
                f"{type(model).__name__}" + (": torch.compile(model) compiles model.forward only; pass the module "
                                             "itself (model._orig_mod) and compile its rollout as "
                                             "forward=torch.compile(type(module).forward_rollout) (for "
                                             "TinyQwen3: forward=rlk_ops.rollout.model.compiled_rollout(), which "
                                             "keeps the allocator's lookups out of the graph)" if wrapped else ""))
        k_dtype = _k_dtype(model) if forward is None else None   # a custom forward may cast as it likes
        if k_dtype is not None and k_dtype != cache.k[0].dtype:
            # else the first append refused it, after a forward had run
            raise ValueError(f"RolloutEngine: the cache holds {cache.k[0].dtype} but the model's k_proj makes "
                             f"{k_dtype}; make the cache with dtype={k_dtype}")
        cfg = getattr(model, "config", None)
        for name in ("num_layers", "num_kv_heads", "head_dim"):  # the cache must be this model's
            want = getattr(cfg, name, None)
            have = {"num_layers": len(cache.k), "num_kv_heads": cache.k[0].shape[2],
                    "head_dim": cache.k[0].shape[3]}[name]
            if want is not None and want != have:
                raise ValueError(f"RolloutEngine: the cache has {name} = {have} but the model's config has {want}")
        self.model, self.cache = model, cache
        self.max_running, self.chunk = max_running, chunk
        self.sampler = sampler or Sampler()
        self.forward = forward or type(model).forward_rollout  # called as forward(model, ...)
        self.logprobs = logprobs or log_softmax
        # the sampler's temperature (a custom sampler without one: 1): what the recorded log-probs are of
        self.temperature = float(getattr(self.sampler, "temperature", 1.0))
        if self.temperature != 1.0 and logprobs is not None and \
                "temperature" not in inspect.signature(logprobs).parameters:
            raise ValueError(f"RolloutEngine: the sampler draws at temperature {self.temperature}, so the recorded "
                             f"log-probs must be softmax(logits / T)'s; logprobs must then take a temperature= "
                             f"argument (as rlk_ops.rollout.model.log_softmax does)")
        self.on_token = on_token
        self.log: list[StepLog] = []

    def _run(self, seqs: list[SeqResult], tokens: list[list[int]], starts: list[int]):
        """Forward the given new tokens of each sequence (same count each); returns
        log-probs [B, Sq, vocab] and records the per-layer attention trace."""
        dev = self.cache.device
        slots = self.cache.reserve_batch([(s.seq_id, len(t)) for s, t in zip(seqs, tokens)])
        tok = torch.tensor(tokens, dtype=torch.int64, device=dev)
        pos = torch.tensor([[st + j for j in range(len(t))] for st, t in zip(starts, tokens)], dtype=torch.int64,
                           device=dev)
        trace = Trace()
        with torch.inference_mode():  # also skips the ops' Python autograd wrappers (~5 us per call)
            logits = self.forward(self.model, tok, pos, self.cache, [s.seq_id for s in seqs], slots, trace=trace)
        # one copy to the host per traced tensor (a copy per row and layer was B x layers syncs on CUDA)
        attn, lse = [a.cpu() for a in trace.attn], [x.cpu() for x in trace.lse]
        row = 0
        for s, st, t in zip(seqs, starts, tokens):
            for j in range(len(t)):
                s.attn[st + j] = [a[row] for a in attn]
                s.lse[st + j] = [x[row] for x in lse]
                row += 1
        b, sq, v = logits.shape
        flat = logits.reshape(b * sq, v)
        logp = self.logprobs(flat).reshape(b, sq, v)
        if self.temperature == 1.0:
            return logp, logp
        # a tempered sampler draws from softmax(logits / T): its log-probs are recorded (the sampler's
        # scores keep their bits: argmax(logp / T + gumbel) picks the tokens it picked before)
        return logp, self.logprobs(flat, temperature=self.temperature).reshape(b, sq, v)

    def _emit(self, s: SeqResult, req: Request, rows: tuple[torch.Tensor, torch.Tensor]) -> None:
        logp_row, record_row = rows
        position = len(s.tokens)
        if req.forced is not None:
            token = req.forced[len(s.generated)]
        else:
            token = self.sampler(s.seq_id, position, logp_row)
            # the sampler's token is checked as the prompt's are: -1 once came back as a result with token
            # vocab-1's log-prob (a negative index), and past the vocabulary failed a step later in the
            # embedding, naming neither (a session 34 audit)
            if not _integer(token) or not 0 <= token < logp_row.shape[-1]:
                raise ValueError(f"the sampler returned {type(token).__name__} {short_repr(token)} for request "
                                 f"{s.seq_id} at position {position}; a token id must be an int in "
                                 f"[0, {logp_row.shape[-1]}) (the vocabulary)")
            token = int(token)
        s.generated.append(token)
        s.logprobs.append(float(record_row[token]))
        if self.on_token:
            self.on_token(1)

    def _check(self, requests: list[Request]) -> None:
        """Every request before any is admitted: the run then either finishes or fails
        without leaving a sequence in the cache (``run`` releases what it admitted)."""
        vocab = getattr(getattr(self.model, "config", None), "vocab_size", None)
        seen: set = set()
        for r in requests:
            if not isinstance(r, Request):
                raise ValueError(f"requests must be Request objects, got {type(r).__name__}")
            for name, toks in (("prompt", r.prompt), ("forced", r.forced)):
                if not isinstance(toks, (list, tuple)) and not (name == "forced" and toks is None):
                    # a tensor or an array once failed on its truth value
                    raise ValueError(f"request {r.seq_id!r}: {name} must be a list of token ids"
                                     f"{' or None' if name == 'forced' else ''}, got {type(toks).__name__} "
                                     f"(e.g. tensor.tolist())")
            if not _integer(r.seq_id) or not 0 <= r.seq_id < 2 ** 63:
                raise ValueError(f"request seq_id must be an int in [0, 2**63), got {type(r.seq_id).__name__} "
                                 f"{r.seq_id!r}")
            if r.seq_id in seen or r.seq_id in self.cache:
                raise ValueError(f"request {r.seq_id!r}: seq_id appears twice in the requests or is already in "
                                 f"the cache; each running sequence needs its own id")
            seen.add(r.seq_id)
            if not r.prompt or not _integer(r.max_new_tokens) or r.max_new_tokens < 1:
                raise ValueError(f"request {r.seq_id}: needs a non-empty prompt and an int max_new_tokens >= 1, got "
                                 f"{len(r.prompt)} prompt tokens and max_new_tokens {r.max_new_tokens!r}")
            if r.forced is not None and len(r.forced) < r.max_new_tokens:
                raise ValueError(f"request {r.seq_id}: {len(r.forced)} forced tokens < max_new_tokens {r.max_new_tokens}")
            if not isinstance(r.stop_tokens, (list, tuple)):
                raise ValueError(f"request {r.seq_id}: stop_tokens must be a list or tuple of token ids, got "
                                 f"{type(r.stop_tokens).__name__}")
            for name, toks in (("prompt", r.prompt), ("forced", r.forced or []), ("stop_tokens", r.stop_tokens)):
                for i, t in enumerate(toks):
                    if not _integer(t) or t < 0 or (vocab is not None and t >= vocab):
                        raise ValueError(f"request {r.seq_id}: {name}[{i}] = {t!r} is not a token id in "
                                         f"[0, {vocab if vocab is not None else 'vocab'})")
            tokens = len(r.prompt) + r.max_new_tokens - 1  # the last generated token is never cached
            pages = self._pages_for(r)
            if pages > self.cache.num_pages:
                raise ValueError(f"request {r.seq_id}: needs {tokens} cached tokens = {pages} pages of "
                                 f"{self.cache.page_size}, but the cache has {self.cache.num_pages} pages")

    def _pages_for(self, req: Request) -> int:
        """Pages ``req`` holds at its end (the last generated token is never cached)."""
        return -(-(len(req.prompt) + req.max_new_tokens - 1) // self.cache.page_size)

    def _no_pages(self, req: Request, free: int) -> CacheFullError:
        return CacheFullError(f"request {req.seq_id}: needs {self._pages_for(req)} pages of {self.cache.page_size} "
                              f"tokens but only {free} of {self.cache.num_pages} are free (the rest held by "
                              f"sequences outside this run)")

    def run(self, requests: list[Request]) -> list[SeqResult]:
        if not isinstance(requests, (list, tuple)):  # a generator was consumed by the checks: nothing ran
            raise ValueError(f"requests must be a list or tuple of Request objects, got {type(requests).__name__}")
        self._check(requests)
        free = self.cache.free_pages   # the most this run can ever hold (other sequences keep theirs)
        for r in requests:
            if self._pages_for(r) > free:
                raise self._no_pages(r, free)
        self.log = []   # this run's steps (a second run appended to the first's)
        running: list[tuple[Request, SeqResult]] = []
        try:
            return self._loop(requests, running)
        except BaseException:
            for _, res in running:  # a failed run leaves no sequence of its own behind
                if res.seq_id in self.cache:
                    self.cache.release(res.seq_id)
            raise

    def _loop(self, requests: list[Request], running: list) -> list[SeqResult]:
        waiting = deque(requests)
        done: dict[int, SeqResult] = {}
        step = 0
        while waiting or running:
            log = StepLog(step, [], [], [], [])
            while waiting and len(running) < self.max_running:
                # admitted only when the cache can hold it to its end next to what the running
                # sequences still need: before, two requests that fit only one after the other were
                # both admitted and the run failed mid-way on a full cache (a session 31 audit)
                req = waiting[0]
                owed = sum(self._pages_for(q) - len(self.cache.pages(r.seq_id)) for q, r in running)
                if self.cache.free_pages - owed < self._pages_for(req):
                    if not running:   # nothing of this run will free a page (pages taken outside it mid-run)
                        raise self._no_pages(req, self.cache.free_pages)
                    break   # waits (in order) for a running sequence to finish
                waiting.popleft()
                self.cache.add(req.seq_id)
                res = SeqResult(req.seq_id, list(req.prompt), admitted_step=step)
                running.append((req, res))
                log.admitted.append(req.seq_id)
            decoding = []
            for req, res in running:
                cached = self.cache.length(res.seq_id)
                if cached < len(res.prompt):  # chunked prefill, one chunk per step
                    stop = min(len(res.prompt), cached + self.chunk)
                    logp, rec = self._run([res], [res.prompt[cached:stop]], [cached])
                    log.prefill.append((res.seq_id, cached, stop))
                    if stop == len(res.prompt):
                        self._emit(res, req, (logp[0, -1], rec[0, -1]))
                else:
                    decoding.append((req, res))
            if decoding:
                seqs = [res for _, res in decoding]
                logp, rec = self._run(seqs, [[res.tokens[-1]] for res in seqs], [len(res.tokens) - 1 for res in seqs])
                for i, (req, res) in enumerate(decoding):
                    self._emit(res, req, (logp[i, 0], rec[i, 0]))
                log.decode = [res.seq_id for res in seqs]
            still = []
            for req, res in running:
                stopped = req.forced is None and bool(res.generated) and res.generated[-1] in req.stop_tokens
                if stopped or len(res.generated) >= req.max_new_tokens:
                    res.finished_step = step
                    res.finish_reason = "stop" if stopped else "length"
                    self.cache.release(res.seq_id)
                    done[res.seq_id] = res
                    log.finished.append(res.seq_id)
                else:
                    still.append((req, res))
            running[:] = still
            self.log.append(log)
            step += 1
        return [done[r.seq_id] for r in requests]


def noise_seed(seed: int, seq_id: int, position: int) -> int:
    """The sampler's generator seed for one (seed, sequence, position): a hash, so that no two
    keys share their noise (a linear mix, seed * 1_000_003 + seq_id * 10_007 + position, gave
    (seq 0, position 10007) the noise of (seq 1, position 0))."""
    key = f"{int(seed)},{int(seq_id)},{int(position)}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") % 2 ** 63


def _k_dtype(model):
    """The dtype of what the model appends to the cache: its first layer's k weight (``k_proj``, or a
    packed ``qkv_proj``; a model may keep its embedding table in another dtype); None where the model has
    no such layer."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        return None
    weight = k_weight(getattr(layers[0], "self_attn", None))
    return weight.dtype if weight is not None else None


def _integer(value) -> bool:
    """An int (numpy's too: numbers.Integral), not a bool or a float."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def cache_for(model, requests: list[Request], page_size: int, max_running: int, device="cpu", seed: int = 0,
              spare_pages: int = 4) -> PagedKVCache:
    """A cache big enough for the ``max_running`` longest requests at once, plus ``spare_pages``."""
    positive_ints("cache_for", page_size=page_size, max_running=max_running)
    if not _integer(spare_pages) or spare_pages < 0:
        raise ValueError(f"cache_for spare_pages must be an int >= 0, got {type(spare_pages).__name__} {spare_pages!r}")
    if not isinstance(requests, (list, tuple)) or not all(isinstance(r, Request) for r in requests):
        bad = requests if not isinstance(requests, (list, tuple)) else next(r for r in requests
                                                                           if not isinstance(r, Request))
        raise ValueError(f"cache_for requests must be a list or tuple of Request objects, got "
                         f"{type(bad).__name__} {bad!r}"[:300])
    cfg = model.config
    need = sorted((math.ceil((len(r.prompt) + r.max_new_tokens) / page_size) for r in requests), reverse=True)
    num_pages = sum(need[:max_running]) + spare_pages
    dtype = _k_dtype(model) or model.embed_tokens.weight.dtype
    return PagedKVCache(cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim, dtype=dtype,
                        device=device, seed=seed)
