"""Versioned msgpack wire format: size limits and schema checks; never pickle.

Every message is a msgpack map with ``"v"`` (the wire version) and ``"t"`` (its type). Anything
else that arrives -- truncated, oversized, wrong types, unknown version -- raises
:class:`~kvx.errors.ProtocolError`.
"""

from __future__ import annotations

from typing import Any, Mapping

import msgpack

from . import config
from .errors import ProtocolError

__all__ = ["VERSION", "pack", "unpack", "check", "frame_header", "parse_frame_header", "HEADER"]

VERSION = 1
#: Lowest peer version this build can talk to.
MIN_VERSION = 1

_MAX_DEPTH = 16


def pack(t: str, **fields: Any) -> bytes:
    """Encode one message of type ``t``."""
    fields["v"] = VERSION
    fields["t"] = t
    return msgpack.packb(fields, use_bin_type=True)


def unpack(data: bytes | bytearray | memoryview, *, max_bytes: int | None = None,
           max_items: int | None = None) -> dict[str, Any]:
    """Decode one message, enforcing the size limit and the envelope.

    ``max_items`` (optional) bounds the items of every msgpack array and map in it: a small frame
    then cannot unpack into a large object graph (frames before authentication).

    Raises
    ------
    ProtocolError
        If the bytes are not exactly one well-formed message of a compatible version.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"expected bytes, got {type(data).__name__}")
    limit = max_bytes if max_bytes is not None else config.get("KVX_MAX_MESSAGE")
    if len(data) > limit:
        raise ProtocolError(f"message of {len(data)} bytes exceeds the limit of {limit}")
    if len(data) == 0:
        raise ProtocolError("empty message")
    try:
        lim: dict[str, int] = {} if max_items is None else {"max_array_len": max_items, "max_map_len": max_items}
        msg = msgpack.unpackb(
            bytes(data),
            raw=False,
            strict_map_key=True,
            use_list=True,
            **lim,
        )
    except (msgpack.ExtraData, ValueError, msgpack.UnpackException, TypeError, RecursionError) as exc:
        raise ProtocolError(f"malformed message: {exc}") from exc
    except Exception as exc:  # msgpack raises a few odd types on hostile input
        raise ProtocolError(f"malformed message: {type(exc).__name__}: {exc}") from exc
    if not isinstance(msg, dict):
        raise ProtocolError("message is not a map")
    v = msg.get("v")
    if not isinstance(v, int) or isinstance(v, bool):
        raise ProtocolError("message has no version")
    if v < MIN_VERSION or v > VERSION:
        raise ProtocolError(f"incompatible wire version {v} (this build speaks {MIN_VERSION}..{VERSION})")
    if not isinstance(msg.get("t"), str):
        raise ProtocolError("message has no type")
    return msg


def check(msg: Mapping[str, Any], t: str, schema: Mapping[str, Any]) -> None:
    """Check type tag and field types. ``schema`` maps field -> type or tuple of types.

    Booleans are not accepted where ints are asked for.
    """
    if msg.get("t") != t:
        raise ProtocolError(f"expected a {t!r} message, got {msg.get('t')!r}")
    for k, typ in schema.items():
        if k not in msg:
            raise ProtocolError(f"{t} message lacks field {k!r}")
        val = msg[k]
        types = typ if isinstance(typ, tuple) else (typ,)
        if isinstance(val, bool) and bool not in types:
            raise ProtocolError(f"{t}.{k} has the wrong type bool")
        if not isinstance(val, types):
            raise ProtocolError(f"{t}.{k} has the wrong type {type(val).__name__}")


# Stream framing: 4-byte magic+kind, 4-byte length (little endian), then the payload.
HEADER = 8
_MAGIC = b"KX"


def frame_header(kind: int, length: int) -> bytes:
    """Header of one stream frame (``kind`` 0..65535)."""
    return _MAGIC + kind.to_bytes(2, "little") + length.to_bytes(4, "little")


def parse_frame_header(h: bytes, max_bytes: int) -> tuple[int, int]:
    """Parse a frame header; raise ProtocolError on bad magic or oversized length."""
    if len(h) != HEADER or h[:2] != _MAGIC:
        raise ProtocolError("bad frame header")
    kind = int.from_bytes(h[2:4], "little")
    length = int.from_bytes(h[4:8], "little")
    if length > max_bytes:
        raise ProtocolError(f"frame of {length} bytes exceeds the limit of {max_bytes}")
    return kind, length
