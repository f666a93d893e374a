"""Issue 26: a model-based test of TieredStore. A hypothesis state machine drives a store with
tiny tiers (host + disk; host + disk + SeaweedFS in the slow suite) against a plain model of what
was put and not deleted, with the write-back workers and promotions running in the background.

Checked at every step: a get returns the put bytes or a miss, never other bytes; a block never
put, or deleted, is never served (not even after the disk tier is reopened); the caller's source
is reused at once after ``put`` and its destination after ``get`` (the store must not read or
write either afterwards). After ``flush``: nothing failed a checksum or a write-back, and a block
put and not deleted is missing only if an eviction removed it from the last tier.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import threading
import time
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import kvx
from kvx.testing import seaweed as _seaweed
from kvx.tiers import DiskTier, HostTier, ObjectTier, TieredStore
from kvx.tiers.events import BlockRemoved, Event
from kvx.tiers.policies import DEFAULT_POLICY

seaweedfs = _seaweed.seaweedfs
s3_env = _seaweed.s3_env

BB = 4096
KEY = st.integers(0, 19)
KEYS = st.lists(KEY, min_size=1, max_size=6)


def content(key: int) -> bytes:
    return hashlib.sha256(str(key).encode()).digest() * (BB // 32)


class TierMachine(RuleBasedStateMachine):
    """Host (3 blocks) over disk (4 blocks); subclasses add an object tier."""

    bucket: str | None = None
    policy = DEFAULT_POLICY

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kvx-model-")
        self.model: set[int] = set()  # put and not deleted since
        self.last_medium = "OBJECT" if self.bucket else "DISK"
        self.evicted: set[int] = set()  # removed from the last tier since their last put
        self.ev_lock = threading.Lock()
        self.held: list[tuple[np.ndarray, int]] = []  # destinations handed back, with their fill
        self.store: TieredStore | None = None
        self.n = 0
        self._open()

    # -- plumbing ---------------------------------------------------------------------------
    def _tiers(self) -> list[Any]:
        tiers: list[Any] = [HostTier(blocks=3), DiskTier(os.path.join(self.dir, "disk"), blocks=4)]
        if self.bucket:
            tiers.append(ObjectTier(self.bucket, blocks=8, prefix=os.path.basename(self.dir), pack_blocks=2,
                                    journal=os.path.join(self.dir, "objects")))
        return tiers

    #: one agent for every store of the run (a class's stores, in turn): hypothesis opens
    #: thousands of stores while it shrinks, and each private agent costs its backends' set-up
    _agent: kvx.Agent | None = None

    def _open(self) -> None:
        cls = type(self)
        if cls.__dict__.get("_agent") is None:  # per class: a subclass needs other backends
            cls._agent = kvx.Agent(f"model-{cls.__name__}", kvx.AgentConfig(
                backends=("host", "posix", "s3") if self.bucket else ("host", "posix")))
        self.regs: list[kvx.Registration] = []
        self.store = TieredStore(self._tiers(), block_bytes=BB, policy=self.policy, writeback_depth=4,
                                 writeback_batch=2, get_chunk=2, agent=cls.__dict__["_agent"])
        self.store.events.subscribe(self._events)
        self.src_buf, self.src = self._lists(8)
        self.dsts = [self._lists(6) for _ in range(2)]

    def _close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None
        for r in self.regs:
            r.release()
        self.regs = []

    def _lists(self, n: int) -> tuple[np.ndarray, kvx.PreparedList]:
        assert self.store is not None
        buf = np.zeros(n * BB, np.uint8)
        reg = self.store.agent.register(buf)
        self.regs.append(reg)
        return buf, self.store.agent.prepare(kvx.DescList.blocks(reg, BB))

    def _events(self, events: list[Event]) -> None:
        with self.ev_lock:
            for e in events:
                if isinstance(e, BlockRemoved) and e.medium == self.last_medium:
                    self.evicted.update(e.block_hashes)  # type: ignore[arg-type]

    def teardown(self) -> None:
        self._close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- rules ------------------------------------------------------------------------------
    @rule(keys=KEYS)
    def put(self, keys: list[int]) -> None:
        assert self.store is not None
        for j, k in enumerate(keys):
            self.src_buf[j * BB:(j + 1) * BB] = np.frombuffer(content(k), np.uint8)
        with self.ev_lock:
            self.evicted.difference_update(keys)
        self.model.update(keys)
        try:
            self.store.put(keys, self.src, list(range(len(keys))))
        except kvx.TierFull:  # pins (and their chains' ancestors) left no room: refused, with a reason
            with self.ev_lock:
                self.evicted.update(keys)
        # a key not stored right after its put was declined by the policy's admission: a miss
        declined = [k for k in keys if self.store.lookup([k]).hits == 0]
        with self.ev_lock:
            self.evicted.update(declined)
        self.src_buf[:] = 0xEE  # the caller reuses its source at once

    @rule(keys=KEYS)
    def get(self, keys: list[int]) -> None:
        assert self.store is not None
        self.n += 1
        buf, dst = self.dsts[self.n % 2]
        buf[:] = 0
        try:
            got = self.store.get(keys, dst, list(range(len(keys))))
        except kvx.BlockNotFound as exc:
            got = exc.args[1]
        for j in range(got):
            k = keys[j]
            assert k in self.model, f"block {k} served but never put (or deleted)"
            assert buf[j * BB:(j + 1) * BB].tobytes() == content(k), f"block {k} served with other bytes"
        fill = 0x40 + self.n % 64
        buf[:] = fill  # the caller reuses its destination at once
        self.held = [(buf, fill)]

    @rule(keys=KEYS)
    def delete(self, keys: list[int]) -> None:
        assert self.store is not None
        self.store.delete(keys)
        self.model.difference_update(keys)

    @rule(keys=KEYS)
    def pin(self, keys: list[int]) -> None:
        assert self.store is not None
        self.store.pin(keys, lease=5.0)

    @rule(keys=KEYS)
    def unpin(self, keys: list[int]) -> None:
        assert self.store is not None
        self.store.unpin(keys)

    @rule(keys=KEYS)
    def lookup(self, keys: list[int]) -> None:
        assert self.store is not None
        self.store.lookup(keys)

    @rule()
    def flush(self) -> None:
        assert self.store is not None
        self.store.flush(timeout=30)
        st_ = self.store.stats()
        for t in st_.tiers:
            assert t["corrupt"] == 0 and t["writeback_errors"] == 0, st_.tiers
        missing = [k for k in sorted(self.model) if self.store.lookup([k]).hits == 0]
        if missing:
            time.sleep(0.2)  # events are emitted just after the lock is released: let them land
        with self.ev_lock:
            lost = [k for k in missing if k not in self.evicted]
        assert not lost, f"blocks {lost} missing after flush without an eviction from the last tier"

    @precondition(lambda self: self.store is not None)
    @rule()
    def reopen(self) -> None:
        """Close the store (its write-back drains) and open it again on the same directory: the
        persistent tiers recover; blocks deleted before must not come back."""
        assert self.store is not None
        self._close()
        self._open()
        assert self.store is not None
        for k in range(20):
            if self.store.lookup([k]).hits:
                assert k in self.model, f"block {k} came back after reopen although it was deleted"
        with self.ev_lock:  # the host tier's blocks are gone with the process: a miss now
            self.evicted.update(self.model)

    @invariant()
    def destinations_untouched(self) -> None:
        for buf, fill in self.held:
            assert (buf == fill).all(), "the store wrote into a destination after get() returned"


TierMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=40, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
TestTierModel = TierMachine.TestCase


class _S3Machine(TierMachine):
    bucket = "kvx-model"


@pytest.mark.slow
@pytest.mark.services
def test_tier_model_with_object_tier(s3_env: _seaweed.SeaweedFS) -> None:
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(_S3Machine, settings=settings(max_examples=10, stateful_step_count=30, deadline=None,
                                                            suppress_health_check=list(HealthCheck)))
