"""The attention contract: what must be equal on both sides for bitwise equality.

``SplitKVPolicy`` names how a query row's keys may be split across workers:

* ``disabled``     one pass over the keys in 128-key blocks (the single-pass definition
                   training uses; the block order is the backend's: the CPU reference
                   ascending, FA4 last to first). Strict.
* ``fixed:N``      split into N-token pieces (FlashInfer ``fixed_split_size``): batch-
                   invariant, but its merge order differs from single pass, so it is not
                   train == rollout unless training uses the same split. Strict only on a
                   backend that proves batch invariance for it.
* ``auto``         the kernel picks the split from the batch: not batch-invariant.
                   Rejected in strict mode; runs only as a diagnostic lane.
* ``canonical:C``  C-token chunks aligned to absolute position 0, merged in ascending
                   order with one fixed fp32 formula, on both sides (train == rollout).
                   ``canonical`` alone is ``canonical:DEFAULT_CANONICAL_CHUNK``.

DEFAULT_CANONICAL_CHUNK = 768 since session 12: the one C that met every canonical:C speed
target of issue 8 in one H200 run (results/h200/session12/canonical_speed.md, page 16, Qwen3-8B
TP=2 shard): decode at batch 1 and 8 within 1.15x of FlashInfer's auto split (worst 1.12x at
1 x 8k), batch 64 no slower than single-pass FA4 (8k: 257.4 against 257.5 us, a tie rather than
a margin; 32k 0.98x), training forward+backward 1.09x of single pass at B=4, S=8k. C = 1024
(the default from session 6 to 11: the smallest power of two training within 1.15x) misses
1 x 8k (1.35x in the same run); 640 misses training (1.16x) and 64 x 8k (1.01x). At page 128
C = 768 misses 64 x 8k (1.03x; canonical_p128.md). Any C a multiple of 128 up to
MAX_CANONICAL_CHUNK (2^20) is accepted.
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import asdict, dataclass

# ASCII digits only (\d would take other scripts' digits), at most 18 (int() of a 5000-digit string
# raises its own error); no surrounding whitespace: one spelling per policy (``_parse_uncached``)
_POLICY = re.compile(r"(disabled|auto|fixed:(-?\d{1,18})|canonical(?::(-?\d{1,18}))?)", re.ASCII)
DEFAULT_CANONICAL_CHUNK = 768
# the largest C accepted: 2^20 tokens, past any context this package serves; the decode layout
# allocates C / page_size page-table columns per pair, so C is bounded, not free
MAX_CANONICAL_CHUNK = 1 << 20
# the largest N of fixed:N: FlashInfer takes the split in pages as an int32, and a value past it wrapped
# to <= 0, which FlashInfer reads as "pick the split from the batch" (not batch-invariant)
MAX_FIXED_SPLIT = (1 << 31) - 1
KINDS = ("disabled", "fixed", "auto", "canonical")


@dataclass(frozen=True)
class SplitKVPolicy:
    kind: str  # disabled | fixed | auto | canonical
    size: int | None = None

    @classmethod
    def parse(cls, text: "str | SplitKVPolicy") -> "SplitKVPolicy":
        if isinstance(text, SplitKVPolicy):
            return text
        return _parse(str(text))

    @classmethod
    def _parse_uncached(cls, text: str) -> "SplitKVPolicy":
        m = _POLICY.fullmatch(text)
        if not m:
            shown = repr(text) if len(text) <= 60 else repr(text[:57]) + "..."
            raise ValueError(f"split_kv must be 'disabled', 'auto', 'fixed:N', 'canonical' or 'canonical:C', "
                             f"got {shown}")
        kind = m.group(1).split(":")[0]
        size = m.group(2) or m.group(3)
        policy = cls(kind, int(size) if size else None)   # __post_init__ checks the size
        if text not in (str(policy), "canonical"):  # e.g. canonical:0768: reports and binding compare the text
            raise ValueError(f"split_kv must be written {str(policy)!r}, got {text!r}")
        return policy

    def __post_init__(self):
        """The same rules as the text form, for a policy built directly (it reached FlashInfer's plan
        unchecked: fixed:0 is FlashInfer's automatic split; a session 34 audit)."""
        kind, size = self.kind, self.size
        if kind not in KINDS:
            raise ValueError(f"split_kv kind must be one of {', '.join(KINDS)}, got {kind!r}")
        if size is not None and (isinstance(size, bool) or not isinstance(size, int)):
            raise ValueError(f"split_kv {kind} size must be an int or None, got {type(size).__name__} {size!r}")
        if kind in ("disabled", "auto") and size is not None:
            raise ValueError(f"split_kv {kind} takes no size, got {size}")
        if kind == "canonical" and size is None:
            object.__setattr__(self, "size", size := DEFAULT_CANONICAL_CHUNK)
        if kind == "canonical" and (size <= 0 or size % 128):
            raise ValueError(f"split_kv canonical:C needs C a positive multiple of 128, got {size}")
        if kind == "canonical" and size > MAX_CANONICAL_CHUNK:
            raise ValueError(f"split_kv canonical:C needs C <= {MAX_CANONICAL_CHUNK} (MAX_CANONICAL_CHUNK), got {size}")
        if kind == "fixed" and (size is None or not 0 < size <= MAX_FIXED_SPLIT):
            raise ValueError(f"split_kv fixed:N needs 0 < N <= {MAX_FIXED_SPLIT} (MAX_FIXED_SPLIT), got {size}")

    def __str__(self) -> str:
        return self.kind if self.size is None else f"{self.kind}:{self.size}"

    @property
    def strict(self) -> bool:
        """Allowed in strict mode (the result does not depend on the batch)."""
        return self.kind != "auto"


def spell(text) -> str:
    """``canonical`` -> ``canonical:768`` (the default written out, so reports and the
    binding compare one spelling); anything else unchanged (the op's check validates it).
    A plain string comparison: it runs inside torch.compile'd code."""
    text = str(text)
    return f"canonical:{DEFAULT_CANONICAL_CHUNK}" if text == "canonical" else text


@functools.lru_cache(maxsize=256)
def _parse(text: str) -> SplitKVPolicy:
    """Every op call validates its policy string: parse each distinct string once."""
    return SplitKVPolicy._parse_uncached(text)


@dataclass(frozen=True)
class AttentionContract:
    """The numerics both sides must share. ``fields()`` is what reports and the
    binding check compare."""
    dtype: str = "bfloat16"
    causal: bool = True
    softmax_scale: float | None = None  # None: head_dim ** -0.5
    head_dim: int = 128
    split_kv: str = "disabled"
    accumulation: str = "fp32"
    lse: str = "natural_log"
    key_block: int = 128
    p_rounding: str = "input_dtype"  # P is fed to the PV product in the input dtype

    def __post_init__(self):
        def bad(name, want):
            raise ValueError(f"AttentionContract {name} must be {want}, got {getattr(self, name)!r}")

        for name in ("head_dim", "key_block"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                bad(name, "a positive int")
        if not isinstance(self.causal, bool):
            bad("causal", "a bool")
        s = self.softmax_scale
        if s is not None and (isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s)):
            bad("softmax_scale", "None (head_dim ** -0.5) or a finite float")
        for name in ("dtype", "accumulation", "lse", "p_rounding"):
            if not isinstance(getattr(self, name), str):
                bad(name, "a string")
        object.__setattr__(self, "split_kv", str(SplitKVPolicy.parse(self.split_kv)))

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5 if self.softmax_scale is None else self.softmax_scale

    def fields(self) -> dict:
        d = asdict(self)
        d["softmax_scale"] = self.scale
        return d
