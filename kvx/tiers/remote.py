"""RemoteTier: the last tier of a :class:`~kvx.tiers.TieredStore` that lives on other machines.

A remote tier is not a slot tier of this node: it has no local index the store can consult
under its lock, no slots to demote into, and its blocks are found by asking it. The store
therefore treats it apart from its local tiers (:class:`~kvx.tiers.HostTier`,
:class:`~kvx.tiers.DiskTier`, :class:`~kvx.tiers.ObjectTier`), through four calls, and only for
what the local tiers miss:

- ``lookup(hashes)``: how many leading blocks of ``hashes`` it holds (no data moved). The store
  asks it for the blocks right after its own stored prefix;
- ``get(hashes, dst, idx)``: read the longest prefix of ``hashes`` it holds into ``dst[idx]``,
  every block verified, and return its length. The store asks for the blocks its local tiers
  missed; what it served is then admitted into the local tiers (``TieredStore(promote=True)``);
- ``put(hashes, src, idx)``: store blocks (a chain: each block's parent is the one before it).
  The store calls it after its own put, with every block of the put, when ``write_through``;
- ``close()``: the store is closing.

A remote tier bounds its own waits and reports failure as a miss: ``lookup`` and ``get`` return
a shorter prefix, ``put`` a smaller count. A :class:`~kvx.KVXError` it raises anyway is logged
and counted by the store (``stats().remote["errors"]``) and taken as a miss.

Its ``src``/``dst`` are prepared lists of the store's agent. A remote tier that moves bytes with
an agent of its own names it as ``agent``; the store then uses that agent (and does not close
it). :class:`kvx.pool.PoolTier` is the implementation kvx ships.

Writing one::

    class MyRemote(RemoteTier):
        medium = "my-cache"

        def lookup(self, hashes): ...
        def get(self, hashes, dst, idx): ...
        def put(self, hashes, src, idx): ...

    store = TieredStore([HostTier(nbytes=8 << 30)], block_bytes=bb, remote=MyRemote())
    # or, the same: TieredStore([HostTier(nbytes=8 << 30), MyRemote()], block_bytes=bb)
"""

from __future__ import annotations

import abc
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from ..agent import Agent, PreparedList

__all__ = ["RemoteTier"]


class RemoteTier(abc.ABC):
    """Base of a store's remote last tier (see the module docstring for the protocol).

    Attributes
    ----------
    medium
        Name of the medium, as KV events and stats report it.
    write_through
        Whether the store puts every block it stores into this tier too (default True). False:
        the store only reads from it (other processes fill it).
    agent
        The agent this tier moves bytes with, which the store must use too (None: the store's
        agent, whichever it is).
    """

    medium: str = "remote"
    write_through: bool = True
    agent: "Agent | None" = None

    def bind(self, block_bytes: int) -> None:
        """Called once by the store that takes this tier, with its block size; raise
        :class:`~kvx.UsageError` if this tier cannot serve blocks of that size."""

    @abc.abstractmethod
    def lookup(self, hashes: Sequence[Hashable]) -> int:
        """Length of the prefix of ``hashes`` this tier holds now."""

    @abc.abstractmethod
    def get(self, hashes: Sequence[Hashable], dst: "PreparedList", idx: np.ndarray) -> int:
        """Read the longest prefix of ``hashes`` this tier holds into ``dst[idx]``, every block
        verified; returns its length (rows of ``dst`` past it may have been written)."""

    @abc.abstractmethod
    def put(self, hashes: Sequence[Hashable], src: "PreparedList", idx: np.ndarray) -> int:
        """Store ``src[idx]`` under ``hashes`` (a chain); returns how many blocks it now holds."""

    def stats(self) -> dict[str, Any]:
        """Counters of this tier (the store adds its own under ``"store"``)."""
        return {"medium": self.medium}

    def close(self) -> None:
        """The store that holds this tier is closing."""
