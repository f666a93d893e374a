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
from array import array
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any, ClassVar

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


_NONE: Any = object()  # "no entry" (a key may be 0, b"" or None-like)


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
        # key (stored or not) -> its stored children: the child itself while it has one (most
        # have: chains), a dict (insertion-ordered) from the second on. Keys are hashable, so
        # never dicts: the type tells the two apart.
        self._children: dict[Hashable, Any] = {}
        self._pinned: set[Hashable] = set()
        self._parked: set[Hashable] = set()  # stored, non-evictable, out of the queues
        self._walk: list[Hashable] | None = None  # cached descent of _evictable_leaf_under
        self._walk_set: set[Hashable] = set()

    # ---------------------------------------------------------------- public protocol
    def admit(self, key: Hashable, parent: Hashable | None) -> bool:
        """May the store insert this new block?  Default: always."""
        return True

    def inserted(self, key: Hashable, parent: Hashable | None) -> None:
        """``key`` is now stored; ``parent`` is the previous block of its chain (or None)."""
        if key in self._parent:
            raise UsageError(f"block {key!r} inserted twice")
        if parent == key or (parent is not None and key in self._children and self._above(parent, key)):
            # A chain that names a block's own descendant as its parent (``key`` left the tier,
            # e.g. deleted, while a child of it stayed, and comes back under that child) would
            # close a loop in the tree, and the walks down it would never end: ``key`` becomes
            # a root instead. Only a key that still has stored children can close one.
            parent = None
        self._parent[key] = parent
        if parent is not None:
            if parent in self._walk_set:
                self._walk = None
                self._walk_set = set()
            children = self._children
            ch = children.get(parent, _NONE)
            if ch is _NONE:
                children[parent] = key
            elif type(ch) is dict:
                ch[key] = None
            else:
                children[parent] = {ch: None, key: None}
        self._on_insert(key, parent)

    def _above(self, node: Hashable, key: Hashable) -> bool:
        """Is ``key`` ``node`` itself or one of its stored ancestors? (The tree has no loops, so
        the walk up ends.)"""
        up = self._parent
        while node is not None:
            if node == key:
                return True
            node = up.get(node)
        return False

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
        children = self._children
        pinned = self._pinned
        while True:
            k = self._peek()
            if k not in children:
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
        # fast path: follow the most recently inserted child down to a leaf. The walk is kept
        # (``_walk``) so that evicting a long chain tail first costs O(1) per block, not
        # O(depth); inserting under a node of the walk, or removing one, invalidates it.
        walk = self._walk
        if walk is not None and walk[0] is k:
            path = walk
        else:
            path = [k]
            self._walk = path
            self._walk_set = {k}
        c = path[-1]
        while True:
            ch = children.get(c, _NONE)
            if ch is _NONE:
                break
            c = next(reversed(ch)) if type(ch) is dict else ch
            path.append(c)
            self._walk_set.add(c)
        if c is not k and c not in pinned:
            path.pop()  # the leaf is about to go
            self._walk_set.discard(c)
            return c
        self._walk = None
        stack = [k]
        while stack:  # slow path (pins in the subtree): any unpinned leaf
            c = stack.pop()
            ch = children.get(c, _NONE)
            if type(ch) is dict:
                stack.extend(ch)
            elif ch is not _NONE:
                stack.append(ch)
            elif c is not k and c not in pinned:
                return c
        return None

    def removed(self, key: Hashable) -> None:
        """``key`` left the tier (eviction, checksum failure, delete)."""
        if key not in self._parent:
            return
        if key in self._walk_set:
            self._walk = None
            self._walk_set = set()
        parent = self._parent.pop(key)
        if key in self._parked:
            self._parked.discard(key)
        else:
            self._on_remove(key)
        self._pinned.discard(key)
        if parent is not None:
            children = self._children
            ch = children[parent]
            if type(ch) is dict:
                del ch[key]
                if len(ch) == 1:
                    children[parent] = next(iter(ch))
            else:
                del children[parent]
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
            if key in self._parked and key not in self._children:
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
class _MiniCache:
    """Metadata-only block cache used as a shadow: ARC with long ghosts, optionally behind a
    doorkeeper (admit a block on its second sighting only).  No chains: it sees a sample of
    keys and counts block-level hits."""

    __slots__ = ("b1", "b2", "cap", "door", "door_cap", "filter", "ghost_cap", "p", "t1", "t2")

    def __init__(self, cap: int, ghost_mult: float, door_mult: float, filter_: bool) -> None:
        self.cap = max(1, cap)
        self.ghost_cap = max(1, int(self.cap * ghost_mult))
        self.door_cap = max(1, int(self.cap * door_mult))
        self.filter = filter_
        self.t1: OrderedDict = OrderedDict()
        self.t2: OrderedDict = OrderedDict()
        self.b1: OrderedDict = OrderedDict()
        self.b2: OrderedDict = OrderedDict()
        self.door: OrderedDict = OrderedDict()
        self.p = 0.0

    def access(self, key: Hashable) -> bool:
        t1, t2 = self.t1, self.t2
        if key in t1:
            del t1[key]
            t2[key] = None
            return True
        if key in t2:
            t2.move_to_end(key)
            return True
        b1, b2 = self.b1, self.b2
        if key in b1:
            self.p = min(self.cap, self.p + max(1.0, len(b2) / len(b1)))
            del b1[key]
            target = t2
        elif key in b2:
            self.p = max(0.0, self.p - max(1.0, len(b1) / len(b2)))
            del b2[key]
            target = t2
        else:
            if self.filter:
                door = self.door
                if key in door:
                    del door[key]
                else:
                    door[key] = None
                    if len(door) > self.door_cap:
                        door.popitem(last=False)
                    return False
            target = t1
        if len(t1) + len(t2) >= self.cap:
            if t1 and (len(t1) > self.p or not t2):
                k, _ = t1.popitem(last=False)
                b1[k] = None
                if len(b1) > self.ghost_cap:
                    b1.popitem(last=False)
            else:
                k, _ = t2.popitem(last=False)
                b2[k] = None
                if len(b2) > self.ghost_cap:
                    b2.popitem(last=False)
        target[key] = None
        return False


_MIX = 0x9E3779B97F4A7C15
_M64 = (1 << 64) - 1


class _KeyTable:
    """A compact table of the last ~``n`` keys seen, with one small count each.

    4-way set-associative, one ``uint32`` per entry: a 16-bit fingerprint of the key, an 8-bit
    stamp (an epoch that advances every ``n / 16`` new keys) and an 8-bit value. A new key takes
    an empty way or the way with the oldest stamp, so each set keeps its most recent keys and
    the table as a whole keeps about the last ``n`` (a soft LRU bound), at 4-8 bytes per key
    instead of the ~130 of an ``OrderedDict`` entry. ``age(key)`` is in epochs (0-255)."""

    __slots__ = ("a", "epoch", "new", "per", "sets")

    WAYS = 4

    def __init__(self, n: int, slack: float = 1.25) -> None:
        self.sets = sets = max(4, (int(n * slack) + self.WAYS - 1) // self.WAYS)
        self.a = array("I", bytes(4 * self.WAYS * sets))
        self.per = max(1, n // 16)
        self.new = 0
        self.epoch = 0

    def _find(self, key: Hashable) -> tuple[int, int, int]:
        """(index of the key's entry or -1, first index of its set, fingerprint)."""
        h = (hash(key) * _MIX) & _M64
        b = ((h * self.sets) >> 64) * 4  # multiply-shift: any number of sets
        fp = ((h >> 8) & 0xFFFF) | 1
        a = self.a
        for i in range(b, b + 4):
            if a[i] >> 16 == fp:
                return i, b, fp
        return -1, b, fp

    def get(self, key: Hashable) -> int | None:
        i, _b, _fp = self._find(key)
        return None if i < 0 else self.a[i] & 0xFF

    def age(self, key: Hashable) -> int | None:
        i, _b, _fp = self._find(key)
        return None if i < 0 else (self.epoch - (self.a[i] >> 8)) & 0xFF

    def put(self, key: Hashable, value: int) -> None:
        """Set the key's value (0-255) and make it the most recent of its set."""
        i, b, fp = self._find(key)
        a = self.a
        ep = self.epoch
        if i < 0:
            oldest = -1
            for j in range(b, b + 4):
                e = a[j]
                if not e:
                    i = j
                    break
                age = (ep - (e >> 8)) & 0xFF
                if age > oldest:
                    oldest, i = age, j
            self.new += 1
            if self.new >= self.per:
                self.new = 0
                self.epoch = (ep + 1) & 0xFF
        a[i] = (fp << 16) | (ep << 8) | (value if value < 0xFF else 0xFF)

    def drop(self, key: Hashable) -> None:
        i, _b, _fp = self._find(key)
        if i >= 0:
            self.a[i] = 0

    @property
    def nbytes(self) -> int:
        return len(self.a) * 4


class _RecentSet:
    """Membership of about the last ``cap`` keys added (a :class:`_KeyTable`: a key is a member
    while fewer than 16 epochs, i.e. ``cap`` additions, have passed since it was added)."""

    __slots__ = ("t",)

    def __init__(self, cap: int) -> None:
        self.t = _KeyTable(cap)

    def __contains__(self, key: Hashable) -> bool:
        a = self.t.age(key)
        return a is not None and a < 16

    def add(self, key: Hashable) -> None:
        self.t.put(key, 1)

    def discard(self, key: Hashable) -> None:
        self.t.drop(key)


class AdaptivePolicy(EvictionPolicy):
    """Default policy: frequency-class expiry eviction, long reuse memory, self-tuning admission.

    * Memory: a history of the last ``history_mult`` x capacity distinct keys seen (stored or
      not) with their access counts, so reuse at distances many times the cache size (the next
      turn of a conversation, the next call of an agent loop) is still recognised.
    * Eviction: a block's *class* is ``bit_length`` of its count before its latest access
      (0: first sighting, 1: second, 2: 3rd-4th, 3: 5th-8th, 4: more), capped at
      ``classes - 1``.  Each class is an LRU queue; a block of class ``c`` last touched at tick
      ``t`` (one tick per block access) is due at ``t + c * lifetime_mult * capacity``, and the
      candidate is the earliest-due queue head (``classes`` comparisons).  Leaves first, a chosen
      candidate's subtree tail first (base class).
    * Admission: a block never seen before is either admitted at once (classic) or only on its
      second sighting within ``door_mult`` x capacity first sightings (a doorkeeper: one-shot
      blocks, e.g. unique tails of prompts, never displace anything).  Recently evicted keys
      (a ghost of ``ghost_mult`` x capacity) are always admitted.  A block whose parent is not
      stored is not admitted (prefix semantics: it cannot be hit before its parent returns).
    * Which admission rule is in force is decided online by two miniature shadow caches
      (spatially sampled keys, capacity scaled by the sampling rate), one per rule; a
      saturating counter moves toward the rule whose shadow hit where the other missed.
    """

    name = "adaptive"
    ghost_mult: ClassVar[float] = 2.0
    door_mult: ClassVar[float] = 4.0
    history_mult: ClassVar[int] = 32
    classes: ClassVar[int] = 5
    lifetime_mult: ClassVar[float] = 1.5
    shadow_blocks: ClassVar[int] = 256  # target shadow capacity (sets the sampling rate)
    min_rate: ClassVar[float] = 1 / 64
    psel_max: ClassVar[int] = 256

    #: the eviction-order experts: lifetime multipliers (0 is exactly LRU order)
    lifetimes: ClassVar[tuple[float, ...]] = (0.0, 1.5)
    expert_blocks: ClassVar[int] = 512  # target capacity of each expert's miniature
    expert_decay: ClassVar[int] = 4096  # sampled accesses per halving of the experts' scores

    def __init__(self, capacity: int, lifetime: float | None = None, expert: bool = False) -> None:
        super().__init__(capacity)
        self._expert = expert
        rate = min(1.0, max(self.min_rate, self.shadow_blocks / capacity))
        self._thresh = int(rate * 65536) if not expert else 0
        scap = max(1, round(capacity * rate))
        self._shadow_admit = _MiniCache(scap, self.ghost_mult, self.door_mult, False)
        self._shadow_filter = _MiniCache(scap, self.ghost_mult, self.door_mult, True)
        self._psel = 0  # > 0: the doorkeeper rule wins
        # eviction order: miniature copies of this policy, one per lifetime, fed with a spatial
        # sample of keys (as chains of their own); the real order follows the best-scoring one
        self._experts: list[AdaptivePolicy] = []
        self._scores: list[float] = []
        self._ethresh = 0
        self._esamples = 0
        if not expert and len(self.lifetimes) > 1:
            erate = min(1.0, max(self.min_rate, self.expert_blocks / capacity))
            self._ethresh = int(erate * 65536)
            ecap = max(2, round(capacity * erate))
            self._experts = [AdaptivePolicy(ecap, lifetime=lt, expert=True) for lt in self.lifetimes]
            self._scores = [0.0] * len(self._experts)
        self._lifetime = self.lifetimes[-1] if lifetime is None else lifetime
        self._door = _RecentSet(max(1, int(capacity * self.door_mult)))  # first sightings
        self._ghost = _RecentSet(max(1, int(capacity * self.ghost_mult)))  # recently evicted keys
        # key -> accesses; 1.6 entries per key: the reuse it must catch is at the far end
        self._hist = _KeyTable(max(1, int(capacity * self.history_mult)), slack=1.6)
        self._tick = 0
        self._cls = 0  # class of the key last accessed (hit / miss)
        n = max(1, int(self.classes))
        self._queues: list[OrderedDict[Hashable, int]] = [OrderedDict() for _ in range(n)]
        self._life = [int(c * self._lifetime * capacity) for c in range(n)]
        self._class_of: dict[Hashable, int] = {}

    @property
    def filtering(self) -> bool:
        """True while new blocks are admitted on their second sighting only."""
        return self._psel > 0

    @property
    def lifetime(self) -> float:
        """The lifetime multiplier in force (0: LRU order)."""
        return self._lifetime

    def _consult(self, key: Hashable) -> None:
        """Feed a sampled key to every expert; follow the one with the best decayed score."""
        scores = self._scores
        for i, e in enumerate(self._experts):
            if key in e._parent:
                e.hit(key)
                scores[i] += 1.0
            else:
                e.miss(key)
                if e.admit(key, None):
                    while len(e._parent) >= e.capacity:
                        e.removed(e.victim())
                    e.inserted(key, None)
        self._esamples += 1
        if self._esamples >= self.expert_decay:
            self._esamples = 0
            self._scores = scores = [x / 2 for x in scores]
        best = max(range(len(scores)), key=lambda i: (scores[i], i))
        lt = self.lifetimes[best]
        if lt != self._lifetime:
            self._lifetime = lt
            cap = self.capacity
            self._life = [int(c * lt * cap) for c in range(len(self._queues))]

    def _observe(self, key: Hashable) -> None:
        hk = ((hash(key) * 2654435761) & 0xFFFFFFFF) >> 16
        if hk < self._ethresh:
            self._consult(key)
        if hk < self._thresh:
            a = self._shadow_admit.access(key)
            f = self._shadow_filter.access(key)
            if a != f:
                if f:
                    if self._psel < self.psel_max:
                        self._psel += 1
                elif self._psel > -self.psel_max:
                    self._psel -= 1
        # access history -> class of this access
        self._tick += 1
        h = self._hist
        n = h.get(key)
        if n is None:
            h.put(key, 1)
            self._cls = 0
        else:
            h.put(key, n + 1)
            c = n.bit_length()
            last = len(self._queues) - 1
            self._cls = c if c < last else last

    def hit(self, key: Hashable) -> None:
        self._observe(key)
        super().hit(key)

    def miss(self, key: Hashable) -> None:
        self._observe(key)

    def admit(self, key: Hashable, parent: Hashable | None) -> bool:
        door = self._door
        if parent is not None and parent not in self._parent:
            # useless until its parent is back; remember the sighting all the same
            door.add(key)
            return False
        if key in self._ghost:
            return True
        if key in door:
            door.discard(key)
            return True
        if self._psel <= 0:
            return True
        door.add(key)
        return False

    # ordering hooks: one LRU queue per class, value = tick of the last access
    def _on_insert(self, key, parent):
        self._ghost.discard(key)
        n = self._hist.get(key) or 1  # accesses, the one that brought it in included
        c = (n - 1).bit_length()
        if c >= len(self._queues):
            c = len(self._queues) - 1
        self._class_of[key] = c
        self._queues[c][key] = self._tick

    def _on_hit(self, key):
        del self._queues[self._class_of[key]][key]
        c = self._cls
        self._class_of[key] = c
        self._queues[c][key] = self._tick

    def _on_remove(self, key):
        del self._queues[self._class_of.pop(key)][key]
        self._ghost.add(key)

    def _detach(self, key):
        del self._queues[self._class_of[key]][key]

    def _attach_front(self, key):
        q = self._queues[self._class_of[key]]
        q[key] = -1  # due before anything of its class
        q.move_to_end(key, last=False)

    def _peek(self):
        best = None
        due = 0
        for q, life in zip(self._queues, self._life):
            if q:
                k = next(iter(q))
                d = q[k] + life
                if best is None or d < due:
                    best, due = k, d
        if best is None:
            raise TierFull("every stored block is pinned or has pinned descendants")
        return best


POLICIES: dict[str, type[EvictionPolicy]] = {}


def _register() -> None:
    for cls in (LRUPolicy, FIFOPolicy, S3FIFOPolicy, ARCPolicy, AdaptivePolicy):
        POLICIES[cls.name] = cls


_register()

DEFAULT_POLICY = AdaptivePolicy.name


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """Build the policy registered as ``name`` for a tier of ``capacity`` blocks."""
    try:
        cls = POLICIES[name.lower() if isinstance(name, str) else name]
    except (KeyError, TypeError):
        known = ", ".join(sorted(POLICIES))
        raise UsageError(f"unknown eviction policy {name!r}; known: {known}") from None
    return cls(capacity)
