"""Append-only index journal of the disk tier: crash recovery after ``kill -9``.

Ordering makes blocks appear atomically: a block's data is written to its slot first, then a
``PUT`` record (key, parent, slot, length, checksum) is appended; before a slot is reused its
``DEL`` record is appended. Each record carries its own CRC, so a torn tail record is ignored
on recovery; a slot overwritten mid-way is caught by the block checksum when it is read.

Records start with the magic ``KN`` and carry the block's 64-bit kvx-nh64 checksum
(:mod:`kvx.tiers.checksum`). Journals of the CRC-32 era (magic ``KJ``, a 32-bit checksum) are
not replayed: recovery stops at the first record whose magic differs, so nothing is read with
the wrong checksum.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Hashable, Iterable, Iterator
from typing import BinaryIO

from ..errors import TierError

__all__ = ["Journal", "encode_key", "decode_key"]

_MAGIC = b"KN"  # b"KJ": the CRC-32 journal of older releases (not replayed)
_PUT, _DEL = 1, 2
_HDR = struct.Struct("<2sBHHIQQ")  # magic, type, keylen, parentlen, slot, checksum, length
_TAIL = struct.Struct("<I")


def encode_key(k: Hashable | None) -> bytes:
    """Keys are bytes (engine block hashes) or ints (trace ids); tagged so both round-trip."""
    if k is None:
        return b""
    if isinstance(k, (bytes, bytearray)):
        return b"b" + bytes(k)
    if isinstance(k, int):
        return b"i" + k.to_bytes(16, "big", signed=True)
    if isinstance(k, str):
        return b"s" + k.encode()
    raise TierError(f"block keys must be bytes, int or str, not {type(k).__name__}")


def decode_key(b: bytes) -> Hashable | None:
    if not b:
        return None
    tag, body = b[:1], b[1:]
    if tag == b"b":
        return body
    if tag == b"i":
        return int.from_bytes(body, "big", signed=True)
    if tag == b"s":
        return body.decode()
    raise ValueError("bad key tag")


class Journal:
    """The index log of one disk tier."""

    def __init__(self, path: str, fsync: bool = False) -> None:
        self.path = path
        self.fsync = fsync
        self._f: BinaryIO = open(path, "ab", buffering=0)

    def _append(self, typ: int, key: Hashable, parent: Hashable | None, slot: int, crc: int, length: int) -> None:
        k, p = encode_key(key), encode_key(parent)
        body = _HDR.pack(_MAGIC, typ, len(k), len(p), slot, crc, length) + k + p
        self._f.write(body + _TAIL.pack(zlib.crc32(body)))
        if self.fsync:
            os.fdatasync(self._f.fileno())

    def put(self, key: Hashable, parent: Hashable | None, slot: int, crc: int, length: int) -> None:
        self._append(_PUT, key, parent, slot, crc, length)

    def put_many(self, records: Iterable[tuple[Hashable, Hashable | None, int, int, int]]) -> None:
        """Append PUT records ``(key, parent, slot, crc, length)`` in one write (one sync)."""
        out = []
        for key, parent, slot, crc, length in records:
            k, p = encode_key(key), encode_key(parent)
            body = _HDR.pack(_MAGIC, _PUT, len(k), len(p), slot, crc, length) + k + p
            out.append(body + _TAIL.pack(zlib.crc32(body)))
        if out:
            self._f.write(b"".join(out))
            if self.fsync:
                os.fdatasync(self._f.fileno())

    def delete(self, key: Hashable, slot: int) -> None:
        self._append(_DEL, key, None, slot, 0, 0)

    def close(self) -> None:
        self._f.close()

    @staticmethod
    def replay(path: str) -> Iterator[tuple[str, Hashable, Hashable | None, int, int, int]]:
        """Yield ``(op, key, parent, slot, crc, length)`` for every intact record, in order."""
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return
        i = 0
        n = len(data)
        while i + _HDR.size + _TAIL.size <= n:
            magic, typ, kl, pl, slot, crc, length = _HDR.unpack_from(data, i)
            end = i + _HDR.size + kl + pl
            if magic != _MAGIC or end + _TAIL.size > n:
                return  # torn or foreign tail: stop
            (rc,) = _TAIL.unpack_from(data, end)
            if zlib.crc32(data[i:end]) != rc:
                return
            try:
                key = decode_key(data[i + _HDR.size: i + _HDR.size + kl])
                parent = decode_key(data[i + _HDR.size + kl: end])
            except (ValueError, UnicodeDecodeError):
                return
            yield ("put" if typ == _PUT else "del"), key, parent, slot, crc, length
            i = end + _TAIL.size

    @staticmethod
    def compact(path: str, live: dict[Hashable, tuple[int, int, int, Hashable | None]]) -> None:
        """Rewrite the journal with one PUT per live block (atomically: write, fsync, rename)."""
        tmp = path + ".tmp"
        j = Journal(tmp)
        for key, (slot, crc, length, parent) in live.items():
            j.put(key, parent, slot, crc, length)
        os.fsync(j._f.fileno())
        j.close()
        os.replace(tmp, path)
