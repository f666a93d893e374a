"""Argument checks at the public boundary: what each kind of argument of kvx's API takes.

Every public constructor and method checks its arguments once, with these helpers, before it
allocates, registers or sends anything. A wrong type raises
:class:`~kvx.errors.ArgumentTypeError` (a ``TypeError``), a value out of range
:class:`~kvx.errors.ArgumentValueError` (a ``ValueError``); the message names the argument
(``what``, e.g. ``"alloc_host nbytes"``) and what it takes. Each check is O(1): hot paths call
them on scalars only, and arrays are checked vectorised where they are built (``DescList``).
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from .errors import ArgumentTypeError, ArgumentValueError

__all__ = ["MAX_BYTES", "MAX_SECONDS", "flag", "integer", "name", "path", "seconds", "size"]

#: Largest size of one region, file, object or descriptor, in bytes (the bound ``DescList``
#: puts on a descriptor's length; well past any memory or file a machine holds).
MAX_BYTES = 1 << 62

#: Upper bound of any timeout, in seconds (about 115 days): larger values overflow the clocks of
#: sockets, locks and native waits.
MAX_SECONDS = 1e7

_INTS = (int, np.integer)
_NUMBERS = (int, float, np.integer, np.floating)


def _type(v: Any) -> str:
    return type(v).__name__


def _bound(n: int) -> str:
    """``n`` as written in the docs: ``2**62`` rather than 4611686018427387904."""
    if n >= 1 << 32 and n & (n - 1) == 0:
        return f"2**{n.bit_length() - 1}"
    if n >= 1 << 32 and (n + 1) & n == 0:
        return f"2**{n.bit_length()} - 1"
    return str(n)


def integer(v: Any, what: str, lo: int, hi: int) -> int:
    """``v`` as an int in ``[lo, hi]`` (a Python or numpy integer; never a bool)."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, _INTS):
        raise ArgumentTypeError(f"{what} must be an int, not {_type(v)}")
    i = int(v)
    if not lo <= i <= hi:
        raise ArgumentValueError(f"{what} must be an int from {_bound(lo)} to {_bound(hi)}, not {i}")
    return i


def size(v: Any, what: str, lo: int = 1) -> int:
    """``v`` as a number of bytes (or blocks) in ``[lo, MAX_BYTES]``."""
    return integer(v, what, lo, MAX_BYTES)


def seconds(v: Any, what: str, *, positive: bool = False) -> float:
    """``v`` as a finite number of seconds, ``>= 0`` (``> 0`` if ``positive``), at most MAX_SECONDS."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, _NUMBERS):
        raise ArgumentTypeError(f"{what} must be a number of seconds, not {_type(v)}")
    f = float(v)
    if not (math.isfinite(f) and (f > 0 if positive else f >= 0) and f <= MAX_SECONDS):
        lo = "positive" if positive else "non-negative"
        raise ArgumentValueError(f"{what} must be a {lo} number of seconds, at most {MAX_SECONDS:g}, not {v!r}")
    return f


def flag(v: Any, what: str) -> bool:
    """``v`` as a bool (``True``/``False`` or a numpy bool)."""
    if not isinstance(v, (bool, np.bool_)):
        raise ArgumentTypeError(f"{what} must be True or False, not {_type(v)}")
    return bool(v)


def name(v: Any, what: str, *, max_len: int | None = None) -> str:
    """``v`` as a non-empty str (of at most ``max_len`` characters)."""
    if not isinstance(v, str):
        raise ArgumentTypeError(f"{what} must be a str, not {_type(v)}")
    if not v or (max_len is not None and len(v) > max_len):
        limit = f" of at most {max_len} characters" if max_len is not None else ""
        raise ArgumentValueError(f"{what} must be a non-empty str{limit}, not {v!r:.80}")
    return v


def path(v: Any, what: str) -> str:
    """``v`` (a str or ``os.PathLike`` of a str) as a non-empty path str without NUL characters."""
    if not isinstance(v, (str, os.PathLike)):
        raise ArgumentTypeError(f"{what} must be a str or os.PathLike, not {_type(v)}")
    try:
        p = os.fspath(v)
    except TypeError as exc:
        raise ArgumentTypeError(f"{what}: {exc}") from None
    if not isinstance(p, str):
        raise ArgumentTypeError(f"{what} must name a path as a str, not {_type(p)}")
    if not p or "\0" in p:
        raise ArgumentValueError(f"{what} must be a non-empty path without NUL characters, not {p!r:.80}")
    return p
