"""Weighted rendezvous (highest-random-weight) placement of block hashes over pool members.

Every client computes the same owners from the same member list, with no index and no master:
for block key ``k`` and member ``m`` of weight ``w_m`` (its capacity), the score is
``-w_m / ln(u(k, m))`` with ``u`` uniform in (0, 1) from a 64-bit mix of the two; the owners of
``k`` are the members of the highest scores. A member that joins takes the keys where it scores
highest -- a ``w_new / sum(w)`` share -- and no other key moves; a member that leaves gives up only
its own keys. Scores are computed for a whole batch at once (numpy, no per-key Python loop beyond
hashing each key once).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import UsageError

__all__ = ["key_bytes", "key64", "member_seed", "Placement", "MAX_KEY"]

#: Longest block hash accepted (bytes); ints are taken as 16-byte two's complement.
MAX_KEY = 64

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)
_S11 = np.uint64(11)
_SEED = np.uint64(0x6B76782D706F6F6C)  # "kvx-pool"
_GOLD = np.uint64(0x9E3779B97F4A7C15)


def key_bytes(h: Any) -> bytes:
    """A block hash as the bytes the pool stores it under (bytes as is, ints as 16 bytes, str tagged)."""
    if type(h) is bytes and 0 < len(h) <= MAX_KEY:  # the usual case, first
        return h
    if isinstance(h, (bytes, bytearray, memoryview)):
        b = bytes(h)
        if not 0 < len(b) <= MAX_KEY:
            raise UsageError(f"a block hash must be 1..{MAX_KEY} bytes, not {len(b)}")
        return b
    if isinstance(h, str):  # (the tiers accept str keys too): tagged, so never equal to a bytes key's
        b = b"\xffs" + h.encode()
        if len(b) > MAX_KEY:
            raise UsageError(f"a str block hash must encode to at most {MAX_KEY - 2} bytes")
        return b
    if isinstance(h, (int, np.integer)) and not isinstance(h, bool):
        try:
            return int(h).to_bytes(16, "little", signed=True)
        except OverflowError:
            raise UsageError("an int block hash must fit in 128 bits") from None
    raise UsageError(f"a block hash must be bytes or an int, not {type(h).__name__}")


def key64(keys: Sequence[bytes]) -> np.ndarray:
    """64-bit digests of normalised keys (at most :data:`MAX_KEY` bytes each), as a uint64 array.

    Vectorised: the keys are zero-padded to a common width of 8-byte words and folded word by
    word through splitmix64's finaliser (each key its own words only), seeded with their lengths
    (so ``b"a"`` and ``b"a\\0"`` differ). A key's digest does not depend on the other keys of the
    batch; every member and client computes the same digests.
    """
    n = len(keys)
    if n == 0:
        return np.zeros(0, dtype=np.uint64)
    lens = np.fromiter(map(len, keys), dtype=np.int64, count=n)
    words = int(-(-int(lens.max()) // 8))
    buf = np.frombuffer(b"".join(k.ljust(words * 8, b"\0") for k in keys), dtype="<u8").reshape(n, words)
    nw = (lens + 7) // 8  # each key folds its own words only: a digest never depends on the batch
    h = _mix(lens.astype(np.uint64) ^ _SEED)
    with np.errstate(over="ignore"):
        for i in range(words):
            h = np.where(i < nw, _mix((h + _GOLD) ^ buf[:, i].astype(np.uint64)), h)
    return h


def member_seed(name: str) -> int:
    """The 64-bit seed of a member name (its identity in placement)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8, person=b"kvx-pool").digest(), "little")


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, vectorised (wrapping uint64 arithmetic)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> _S30)) * _M1
        x = (x ^ (x >> _S27)) * _M2
        return x ^ (x >> _S31)


class Placement:
    """Owners of block keys over a fixed member list.

    Parameters
    ----------
    names
        Member names (their order does not matter: placement depends on names and weights).
    weights
        Positive weight per member (capacity in bytes or blocks: only ratios matter).
    """

    def __init__(self, names: Sequence[str], weights: Sequence[float]) -> None:
        if len(names) != len(weights):
            raise UsageError("one weight per member")
        w = np.asarray(weights, dtype=np.float64)
        if len(w) and not (w > 0).all():
            raise UsageError("member weights must be positive")
        order = np.argsort(np.asarray(names, dtype=object), kind="stable") if len(names) else np.zeros(0, int)
        self.names = [names[int(i)] for i in order]
        self.weights = w[order] if len(w) else w
        self.seeds = np.array([member_seed(n) for n in self.names], dtype=np.uint64)
        self._index = {n: i for i, n in enumerate(self.names)}

    def __len__(self) -> int:
        return len(self.names)

    def index(self, name: str) -> int:
        return self._index[name]

    def scores(self, k64: np.ndarray) -> np.ndarray:
        """``(len(k64), len(members))`` rendezvous scores (higher wins)."""
        h = _mix(k64[:, None] ^ self.seeds[None, :])
        u = ((h >> _S11).astype(np.float64) + 0.5) * (1.0 / (1 << 53))  # in (0, 1)
        return -self.weights[None, :] / np.log(u)

    def owners(self, k64: np.ndarray, replicas: int = 1) -> np.ndarray:
        """Member indices owning each key, best first: an int array ``(len(k64), r)`` with
        ``r = min(replicas, len(self))``."""
        if len(self) == 0:
            raise UsageError("the pool has no member that stores blocks")
        r = max(1, min(int(replicas), len(self)))
        s = self.scores(np.asarray(k64, dtype=np.uint64))
        if r == 1:
            return np.argmax(s, axis=1)[:, None]
        part = np.argpartition(-s, r - 1, axis=1)[:, :r]
        rows = np.arange(len(s))[:, None]
        return part[rows, np.argsort(-s[rows, part], axis=1)]
