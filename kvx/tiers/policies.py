"""Eviction policies of one kvx tier.

A tier stores fixed-size KV blocks keyed by prefix hashes.  Blocks form chains (a request's blocks
``b0 -> b1 -> ...``) and a block is only reusable when all its ancestors are present, so every
policy here evicts *leaves first*: a block is evictable only while none of its stored children
remains and it is not pinned.  The bookkeeping for that rule (parent links, stored-child counts,
pins, "parked" non-evictable keys) lives in :class:`EvictionPolicy`; subclasses only order the
evictable keys.

Calling protocol (the store and :func:`kvx.tiers.sim.simulate` both follow it)::

    for each block offered, in chain order:
        present -> policy.hit(key)
        absent  -> policy.miss(key); if policy.admit(key, parent):
                       while full: k = policy.victim(); <drop k>; policy.removed(k)
                       <store key>; policy.inserted(key, parent)

``victim()`` does not forget the key: it stays tracked (and counted by ``len``) until
``removed(key)``; calling ``victim()`` twice without ``removed`` returns the same key.

All operations are O(1) amortised: ``OrderedDict`` queues, dict counters; a non-evictable key met
at the eviction end is *parked* (taken out of its queue) and put back at the eviction end when it
becomes evictable again (its last child left / it was unpinned), or re-queued by a hit.
See ``docs/policy.md`` for the default policy (``adaptive``).
"""

from __future__ import annotations

import abc
from collections import OrderedDict
from collections.abc import Hashable
from typing import ClassVar

from ..errors import TierFull, UsageError

__all__ = [
    "EvictionPolicy",
    "LRUPolicy",
    "FIFOPolicy",
    "S3FIFOPolicy",
    "ARCPolicy",
    "AdaptivePolicy",
    "POLICIES",
    "DEFAULT_POLICY",
    "make_policy",
]


class EvictionPolicy(abc.ABC):
    """Base class: chain bookkeeping, pins and the leaves-first rule.

    Subclasses implement the ordering hooks ``_on_insert``, ``_on_hit``, ``_on_remove``,
    ``_peek`` (next candidate at the eviction end, may reorganise queues, raises ``TierFull``
    when no queue holds a key), ``_detach`` (take a key out of its queue, for parking) and
    ``_attach_front`` (put a parked key back at the eviction end of its queue).
    """

    name: ClassVar[str] = "base"

    def __init__(self, capacity: int) -> None:
        capacity = int(capacity)
        if capacity < 1:
            raise UsageError(f"policy capacity must be >= 1 block, got {capacity}")
        self.capacity = capacity
        self._parent: dict[Hashable, Hashable | None] = {}  # stored key -> parent at insertion
        self._kids: dict[Hashable, int] = {}  # key (stored or not) -> number of stored children
        self._children: dict[Hashable, dict[Hashable, None]] = {}  # same keys -> stored children
        self._pinned: set[Hashable] = set()
        self._parked: set[Hashable] = set()  # stored, non-evictable, out of the queues

    # ---------------------------------------------------------------- public protocol
    def admit(self, key: Hashable, parent: Hashable | None) -> bool:
        """May the store insert this new block?  Default: always."""
        return True

    def inserted(self, key: Hashable, parent: Hashable | None) -> None:
        """``key`` is now stored; ``parent`` is the previous block of its chain (or None)."""
        if key in self._parent:
            raise UsageError(f"block {key!r} inserted twice")
        if parent == key:
            parent = None
        self._parent[key] = parent
        if parent is not None:
            kids = self._kids
            kids[parent] = kids.get(parent, 0) + 1
            ch = self._children.get(parent)
            if ch is None:
                self._children[parent] = {key: None}
            else:
                ch[key] = None
        self._on_insert(key, parent)

    def hit(self, key: Hashable) -> None:
        """A stored block was accessed."""
        if key in self._parked:
            self._parked.discard(key)
            self._attach_front(key)
        self._on_hit(key)

    def miss(self, key: Hashable) -> None:
        """A looked-up key is not stored (ghost tracking / adaptation).  Default: nothing."""

    def victim(self) -> Hashable:
        """The next key to evict: stored, unpinned, without stored children.

        The subclass names a candidate (``_peek``).  If the candidate still has stored
        descendants, its subtree goes first, tail first: a descendant is useless without it
        (prefix semantics), so the policy's choice of the candidate is a choice of the whole
        subtree.  A candidate whose subtree holds no evictable leaf (pins) is parked.
        """
        kids = self._kids
        pinned = self._pinned
        while True:
            k = self._peek()
            if not kids.get(k):
                if k not in pinned:
                    return k
            elif self.subtree_first:
                leaf = self._evictable_leaf_under(k)
                if leaf is not None:
                    return leaf
            self._detach(k)
            self._parked.add(k)

    subtree_first: ClassVar[bool] = True

    def _evictable_leaf_under(self, k: Hashable) -> Hashable | None:
        children, pinned = self._children, self._pinned
        # fast path: follow the most recently inserted child down to a leaf
        c = k
        while True:
            ch = children.get(c)
            if not ch:
                break
            c = next(reversed(ch))
        if c is not k and c not in pinned:
            return c
        stack = [k]
        while stack:  # slow path (pins in the subtree): any unpinned leaf
            c = stack.pop()
            ch = children.get(c)
            if ch:
                stack.extend(ch)
            elif c is not k and c not in pinned:
                return c
        return None

    def removed(self, key: Hashable) -> None:
        """``key`` left the tier (eviction, checksum failure, delete)."""
        if key not in self._parent:
            return
        parent = self._parent.pop(key)
        if key in self._parked:
            self._parked.discard(key)
        else:
            self._on_remove(key)
        self._pinned.discard(key)
        if parent is not None:
            kids = self._kids
            n = kids[parent] - 1
            if n:
                kids[parent] = n
                del self._children[parent][key]
            else:
                del kids[parent]
                del self._children[parent]
                if parent in self._parked and parent not in self._pinned:
                    self._parked.discard(parent)
                    self._attach_front(parent)

    def set_evictable(self, key: Hashable, ok: bool) -> None:
        """Pin (``ok=False``) or unpin a stored block."""
        if key not in self._parent:
            return
        if not ok:
            self._pinned.add(key)
        elif key in self._pinned:
            self._pinned.discard(key)
            if key in self._parked and not self._kids.get(key):
                self._parked.discard(key)
                self._attach_front(key)

    def __len__(self) -> int:
        return len(self._parent)

    def __contains__(self, key: object) -> bool:
        return key in self._parent

    def parent_of(self, key: Hashable) -> Hashable | None:
        """The parent ``key`` was inserted with (None for a root)."""
        return self._parent[key]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(capacity={self.capacity}, stored={len(self)})"

    # ---------------------------------------------------------------- hooks
    @abc.abstractmethod
    def _on_insert(self, key: Hashable, parent: Hashable | None) -> None: ...

    @abc.abstractmethod
    def _on_hit(self, key: Hashable) -> None: ...

    @abc.abstractmethod
    def _on_remove(self, key: Hashable) -> None: ...

    @abc.abstractmethod
    def _peek(self) -> Hashable: ...

    @abc.abstractmethod
    def _detach(self, key: Hashable) -> None: ...

    @abc.abstractmethod
    def _attach_front(self, key: Hashable) -> None: ...


def _first(od: OrderedDict) -> Hashable:
    return next(iter(od))


# -------------------------------------------------------------------- classics
class LRUPolicy(EvictionPolicy):
    """Least recently used leaf first."""

    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._q: OrderedDict[Hashable, None] = OrderedDict()  # eviction end first

    def _on_insert(self, key, parent):
        self._q[key] = None

    def _on_hit(self, key):
        self._q.move_to_end(key)

    def _on_remove(self, key):
        del self._q[key]

    def _peek(self):
        if not self._q:
            raise TierFull("every stored block is pinned or has pinned descendants")
        return next(iter(self._q))

    def _detach(self, key):
        del self._q[key]

    def _attach_front(self, key):
        self._q[key] = None
        self._q.move_to_end(key, last=False)


class FIFOPolicy(LRUPolicy):
    """First in, first out (hits do not reorder); leaves first."""

    name = "fifo"

    def _on_hit(self, key):
        pass


class S3FIFOPolicy(EvictionPolicy):
    """S3-FIFO (Yang et al., SOSP'23): small probation FIFO (10%), main FIFO with 2-bit
    frequency reinsertion, ghost FIFO of keys evicted from the small queue."""

    name = "s3fifo"
    small_ratio: ClassVar[float] = 0.10
    promote_freq: ClassVar[int] = 1  # small -> main when freq >= this at eviction

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._small: OrderedDict[Hashable, None] = OrderedDict()
        self._main: OrderedDict[Hashable, None] = OrderedDict()
        self._ghost: OrderedDict[Hashable, None] = OrderedDict()
        self._freq: dict[Hashable, int] = {}
        self._small_target = max(1, int(capacity * self.small_ratio))
        self._ghost_cap = max(1, capacity - self._small_target)

    def _on_insert(self, key, parent):
        self._freq[key] = 0
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None

    def _on_hit(self, key):
        f = self._freq[key]
        if f < 3:
            self._freq[key] = f + 1

    def _on_remove(self, key):
        del self._freq[key]
        if key in self._small:
            del self._small[key]
            g = self._ghost
            g[key] = None
            if len(g) > self._ghost_cap:
                g.popitem(last=False)
        else:
            del self._main[key]

    def _detach(self, key):
        if key in self._small:
            del self._small[key]
        else:
            del self._main[key]

    def _attach_front(self, key):
        # a parked key returns to the main queue's eviction end (it has survived probation
        # or was reinserted; either way main is where chains' interior blocks live)
        self._main[key] = None
        self._main.move_to_end(key, last=False)

    def _peek(self):
        small, main, freq = self._small, self._main, self._freq
        while True:
            if small and (len(small) >= self._small_target or not main):
                k = next(iter(small))
                if freq[k] >= self.promote_freq:
                    del small[k]
                    main[k] = None
                    freq[k] = 0
                    continue
                return k
            if not main:
                raise TierFull("every stored block is pinned or has pinned descendants")
            k = next(iter(main))
            f = freq[k]
            if f:
                freq[k] = f - 1
                main.move_to_end(k)
                continue
            return k


class ARCPolicy(EvictionPolicy):
    """Adaptive Replacement Cache (Megiddo & Modha, FAST'03) over leaves."""

    name = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._t1: OrderedDict[Hashable, None] = OrderedDict()
        self._t2: OrderedDict[Hashable, None] = OrderedDict()
        self._b1: OrderedDict[Hashable, None] = OrderedDict()
        self._b2: OrderedDict[Hashable, None] = OrderedDict()
        self._p = 0.0
        self._in_t2: dict[Hashable, bool] = {}

    def miss(self, key):
        c = self.capacity
        if key in self._b1:
            self._p = min(c, self._p + max(1.0, len(self._b2) / max(1, len(self._b1))))
        elif key in self._b2:
            self._p = max(0.0, self._p - max(1.0, len(self._b1) / max(1, len(self._b2))))

    def _on_insert(self, key, parent):
        if key in self._b1 or key in self._b2:
            self._b1.pop(key, None)
            self._b2.pop(key, None)
            self._t2[key] = None
            self._in_t2[key] = True
        else:
            self._t1[key] = None
            self._in_t2[key] = False

    def _on_hit(self, key):
        if self._in_t2[key]:
            self._t2.move_to_end(key)
        else:
            del self._t1[key]
            self._t2[key] = None
            self._in_t2[key] = True

    def _on_remove(self, key):
        c = self.capacity
        if self._in_t2.pop(key):
            del self._t2[key]
            self._b2[key] = None
            if len(self._b2) > c:
                self._b2.popitem(last=False)
        else:
            del self._t1[key]
            self._b1[key] = None
            if len(self._b1) > c:
                self._b1.popitem(last=False)

    def _detach(self, key):
        if self._in_t2[key]:
            del self._t2[key]
        else:
            del self._t1[key]

    def _attach_front(self, key):
        q = self._t2 if self._in_t2[key] else self._t1
        q[key] = None
        q.move_to_end(key, last=False)

    def _peek(self):
        t1, t2 = self._t1, self._t2
        if t1 and (len(t1) > self._p or not t2):
            return next(iter(t1))
        if t2:
            return next(iter(t2))
        if t1:
            return next(iter(t1))
        raise TierFull("every stored block is pinned or has pinned descendants")


# -------------------------------------------------------------------- default
AdaptivePolicy = None  # defined below


POLICIES: dict[str, type[EvictionPolicy]] = {}


def _register() -> None:
    for cls in (LRUPolicy, FIFOPolicy, S3FIFOPolicy, ARCPolicy):
        POLICIES[cls.name] = cls


_register()

DEFAULT_POLICY = "lru"


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """Build the policy registered as ``name`` for a tier of ``capacity`` blocks."""
    try:
        cls = POLICIES[name.lower() if isinstance(name, str) else name]
    except (KeyError, TypeError):
        known = ", ".join(sorted(POLICIES))
        raise UsageError(f"unknown eviction policy {name!r}; known: {known}") from None
    return cls(capacity)
