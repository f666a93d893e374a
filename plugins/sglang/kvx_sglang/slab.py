"""A slab file of fixed-size KV pages with a journaled, checksummed key index.

One ``kvx.FileRegion`` holds ``capacity`` slots of ``page_bytes``; a page is stored as its
fragments back to back (see :mod:`kvx_sglang.layout`), so a batch of pages moves between the
host pool and the slab in one kvx transfer (the ``posix`` backend's vectored I/O).

The index (key -> slot, checksum) lives in memory and in an append-only journal next to the
slab: ``[op, key, slot, checksum]`` msgpack records, one write per batch, appended only after
the pages' bytes were written. At start the journal is replayed (a torn tail is ignored), so
stored pages survive a restart; a page whose bytes did not reach the file fails its checksum
when read and is a miss, never returned. Readers that do not write (MLA ranks other than the
writer) follow the writer's journal.

Eviction is least-recently-used over whole pages when the slab is full.

Writes: given a :class:`PwritevWriter` (a second kvx agent whose posix backend writes with
``pwritev``, not through a mapping), every page is written with one ``pwritev`` of its fragments.
Through the mapping (what the posix backend does for a buffered write) a first write into a slot
is a write fault per run whose readahead allocates large folios and zero-fills them before the
copy fills them again, and a rewrite of a slot whose pages are mapped read-only (read back since,
or cleaned by writeback: the steady state of a full store) is a write fault per 4 KiB page; the
kernel's write path allocates page-cache folios no larger than the write and copies into them
once, as HiCacheNixl's one-file-per-page ``pwrite`` does, and rewrites cached pages without a
fault (docs/benchmarks.md, "HiCache gets and rewrites"). Reads copy out of the mapping.

Prefault (optional, ``prefault`` bytes, off by default): the slots next in line for a first write
get their page cache ahead of time, by a background thread that stays that far ahead of the fill,
starting when the slab is opened (opening does not wait for it): it writes zeros into them with
``pwrite`` (the kernel's write path allocates the folios; the set then rewrites cached pages,
about half the kernel time of a first write). A range the thread is writing is claimed under the
index lock, and a put handed a slot in it waits for that one step to end before it writes, so a
zero never lands on a stored page. (It used ``MADV_POPULATE_READ`` over a mapping before: on
ext4 that costs ~1.7 s per GiB of never-written slab, about 20x a zero write, and the following
first writes were no cheaper; docs/benchmarks.md, "HiCache first fill".) It trades CPU for set
latency: zeros plus a rewrite cost more kernel time than one first write.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

import kvx
from kvx import DescList, MemoryKind, UsageError

from .layout import PageGeometry

log = logging.getLogger(__name__)

#: Longest key the index accepts (SGLang's are 64 hex digits plus a short scope suffix).
MAX_KEY = 1024
_PUT, _DEL = 0, 1
_FORMAT = 2  # 2: kvx-nh64 page checksums (1: xxh3)


@dataclass(frozen=True, slots=True)
class PwritevWriter:
    """What pages are written to the slab with: an agent whose posix backend uses ``pwritev``.

    Attributes
    ----------
    agent
        A kvx agent with the ``posix`` backend and ``PosixOptions(mmap=False)``; it holds the
        host pool's registration too. The slab registers its file with it.
    host
        The host pool's page fragments prepared by ``agent`` (the same rows as the main list).
    digest
        ``digest(host_pages) -> uint64 array``, as :class:`SlabStore`'s, for pages moved by
        ``agent``.
    """

    agent: kvx.Agent
    host: kvx.PreparedList
    digest: Callable[[np.ndarray], np.ndarray]


class SlabStore:
    """Pages of one host-pool geometry in ``{directory}/{name}.slab`` (+ ``.log``, ``.meta``).

    Parameters
    ----------
    agent
        The kvx agent that moves the bytes (holds the host pool's registration).
    directory, name
        Where the files go; ``name`` carries the model/rank scope.
    geom
        The page geometry (fragment sizes and offsets) of the host pool.
    capacity
        Slots (pages) in the slab.
    writer
        False: only read, following the journal another process writes.
    digest
        ``digest(host_pages) -> uint64 array``: checksum of host-pool pages, called right after
        the transfer that moved them finished (the posix copy may have taken it already).
    timeout
        Seconds a batch transfer may take.
    chunks
        A get is read and verified in this many transfers (checksumming in Python then
        overlaps the reading); 1 where the copy takes the checksums.
    prefault
        Bytes of never-written slots kept in the page cache (written with zeros) ahead of the fill
        (0: none), by a background thread that starts with the first window when the slab is opened.
    fill
        Write pages with ``pwritev`` through this agent (see the module docstring); None: every
        write goes through ``agent`` (its mapping, or O_DIRECT).
    """

    #: Bytes the prefault thread zeroes per step (a stop request, or a put handed a slot in the
    #: step, waits for at most one).
    PREFAULT_STEP = 4 << 20
    #: Bytes of one zero write of the prefault (see :meth:`_pf_write`).
    PREFAULT_WRITE = 256 << 10

    #: Transfers per get when the checksums are taken in Python.
    CHUNKS = 4

    def __init__(self, agent: kvx.Agent, directory: str, name: str, geom: PageGeometry, capacity: int,
                 digest: Callable[[np.ndarray], np.ndarray], writer: bool = True, timeout: float = 60.0,
                 fsync: bool = False, chunks: int = CHUNKS, prefault: int = 0,
                 fill: PwritevWriter | None = None) -> None:
        if capacity <= 0:
            raise UsageError("slab capacity must be at least one page")
        self.agent = agent
        self.geom = geom
        self.capacity = int(capacity)
        self.digest = digest
        self.writer = writer
        self.timeout = timeout
        self.fsync = fsync
        self.chunks = max(1, int(chunks))
        self._lock = threading.Lock()
        self._index: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self._free: list[int] = []
        os.makedirs(directory, exist_ok=True)
        self.slab_path = os.path.join(directory, f"{name}.slab")
        self.log_path = os.path.join(directory, f"{name}.log")
        meta_path = os.path.join(directory, f"{name}.meta")
        want = f"kvx-sglang {_FORMAT} {geom.page_bytes} {capacity} {','.join(map(str, geom.sizes.tolist()))}\n"
        have = None
        if os.path.exists(meta_path):
            with open(meta_path) as f:
                have = f.read()
        if have != want:
            if not writer:
                raise UsageError(f"no slab of this geometry at {self.slab_path} (the writer has not created it)")
            for p in (self.log_path, self.slab_path):
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass
            tmp = meta_path + ".tmp"
            with open(tmp, "w") as f:
                f.write(want)
            os.replace(tmp, meta_path)
        self._reg = agent.register(kvx.FileRegion(self.slab_path, self.capacity * geom.page_bytes))
        file_id = int(self._reg.descs.dev[0])
        slot_base = np.arange(self.capacity, dtype=np.int64)[:, None] * geom.page_bytes
        addr = (slot_base + geom.offsets[None, :]).ravel()
        self._plist = agent.prepare(DescList.from_arrays(
            kind=MemoryKind.FILE, addr=addr, nbytes=np.tile(geom.sizes, self.capacity), dev=file_id))
        self._fill = fill if writer else None
        self._fill_reg: kvx.Registration | None = None
        if self._fill is not None:
            self._fill_reg = self._fill.agent.register(kvx.FileRegion(self.slab_path, self.capacity * geom.page_bytes))
            self._fill_plist = self._fill.agent.prepare(DescList.from_arrays(
                kind=MemoryKind.FILE, addr=addr, nbytes=np.tile(geom.sizes, self.capacity),
                dev=int(self._fill_reg.descs.dev[0])))
        self._log_pos = 0
        self._log_ino = -1
        self._records = 0
        self._log: Any = None
        self._replay()
        if writer:
            self._compact()
        used = {s for s, _ in self._index.values()}
        self._free = [s for s in range(self.capacity - 1, -1, -1) if s not in used]
        # slots from _fresh on were never handed out since the slab was opened (the free list
        # hands out the lowest first); the prefault keeps [_fresh, _fresh + window) in the cache
        self._fresh = max(used) + 1 if used else 0
        self._pf_window = min(int(prefault), self.capacity * geom.page_bytes) if writer else 0
        self._pf_done = 0  # bytes of the slab populated from its start
        self._pf_seconds = 0.0
        self._pf_busy = False
        self._pf_stop = False
        self._pf_cv = threading.Condition(threading.Lock())
        self._pf_claim: tuple[int, int] | None = None  # bytes [a, b) being zeroed (set under _lock)
        self._pf_fd = -1
        self._pf_zeros = memoryview(b"")
        self._pf_thread: threading.Thread | None = None
        if self._pf_window > 0:
            self._start_prefault()

    # ------------------------------------------------------------------------------------
    def _replay(self) -> None:
        """Apply journal records past ``_log_pos`` (all of them at start, or when the writer
        compacted the journal into a new file)."""
        try:
            with open(self.log_path, "rb") as f:
                ino = os.fstat(f.fileno()).st_ino
                if ino != self._log_ino:  # a new journal: read it from the start
                    self._index.clear()
                    self._log_pos = 0
                    self._log_ino = ino
                f.seek(self._log_pos)
                data = f.read()
        except FileNotFoundError:
            return
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=max(len(data), 1 << 16),
                                    max_str_len=MAX_KEY, max_array_len=4)
        unpacker.feed(data)
        pos = 0
        try:
            for rec in unpacker:
                if (not isinstance(rec, list) or len(rec) != 4 or rec[0] not in (_PUT, _DEL)
                        or not isinstance(rec[1], str) or not isinstance(rec[2], int)
                        or not isinstance(rec[3], int) or not 0 <= rec[2] < self.capacity):
                    log.warning("journal %s: bad record at byte %d; ignoring the rest",
                                self.log_path, self._log_pos + pos)
                    break
                op, key, slot, csum = rec
                if op == _PUT:
                    for k in [k for k, (s, _) in self._index.items() if s == slot]:
                        del self._index[k]  # the slot was reused
                    self._index[key] = (slot, csum)
                else:
                    cur = self._index.get(key)
                    if cur is not None and cur[0] == slot:
                        del self._index[key]
                pos = unpacker.tell()
                self._records += 1
        except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError) as exc:
            log.warning("journal %s: unreadable record (%s); ignoring the rest", self.log_path, exc)
        self._log_pos += pos

    def _compact(self) -> None:
        """Rewrite the journal as one record per stored page (a new file, renamed into place)."""
        tmp = self.log_path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(b"".join(msgpack.packb([_PUT, k, slot, c]) for k, (slot, c) in self._index.items()))
            f.flush()
            if self.fsync:
                os.fdatasync(f.fileno())
        if self._log is not None:
            self._log.close()
        os.replace(tmp, self.log_path)
        self._log = open(self.log_path, "ab")
        self._log_ino = os.fstat(self._log.fileno()).st_ino
        self._records = len(self._index)

    def _append(self, records: list[list[Any]]) -> None:
        if self._log is None or not records:
            return
        self._records += len(records)
        if self._records > 4 * self.capacity + 4096:  # mostly dead records: start a fresh journal
            self._compact()
            return
        self._log.write(b"".join(msgpack.packb(r) for r in records))
        self._log.flush()
        if self.fsync:
            os.fdatasync(self._log.fileno())

    # ------------------------------------------------------------------------------------
    def _start_prefault(self) -> None:
        try:
            self._pf_fd = os.open(self.slab_path, os.O_WRONLY | os.O_CLOEXEC)
        except OSError as exc:
            log.warning("slab %s: no prefault (cannot open it: %s)", self.slab_path, exc)
            return
        self._pf_done = self._fresh * self.geom.page_bytes
        self._pf_zeros = memoryview(bytearray(self.PREFAULT_WRITE))  # the source of every zero write
        # the first window too is populated by the thread: building the store does not wait for it
        self._pf_busy = True
        self._pf_thread = threading.Thread(target=self._prefault_loop, name="kvx-slab-prefault", daemon=True)
        self._pf_thread.start()

    def _pf_write(self, zeros: memoryview, a: int, n: int) -> None:
        """``n`` zero bytes into the slab at byte ``a`` (one prefault step), a write per ``zeros``:
        writes of a few hundred KiB (the kernel sizes its page-cache folios by the write; 4 MiB
        writes cost ~20x more kernel time per byte, in the allocation of the larger folios)."""
        end = a + n
        while a < end:
            k = os.pwrite(self._pf_fd, zeros[:min(len(zeros), end - a)], a)
            if k <= 0:
                raise OSError(f"pwrite wrote nothing at byte {a}")
            a += k

    def _prefault_to(self, want: int) -> bool:
        """Zero the never-written slots from ``_pf_done`` up to ``want`` bytes, a step at a time;
        False when the kernel refuses (the prefault is turned off) or a stop was asked."""
        step = self.PREFAULT_STEP
        zeros = self._pf_zeros
        pb = self.geom.page_bytes
        while self._pf_done < want:
            if self._pf_stop:
                return False
            with self._lock:  # never below the first slot not yet handed out
                a = max(self._pf_done, self._fresh * pb)
                n = min(step, want - a)
                if n <= 0:
                    self._pf_done = max(self._pf_done, a)
                    return True
                self._pf_claim = (a, a + n)
            t0 = time.thread_time()
            try:
                self._pf_write(zeros, a, n)
            except OSError as exc:  # ENOSPC on a thin file system, EIO, the file cut short
                log.warning("slab %s: prefault stopped (%s); first writes allocate their pages themselves",
                            self.slab_path, exc)
                self._pf_window = 0
                return False
            finally:
                with self._pf_cv:
                    self._pf_claim = None
                    self._pf_cv.notify_all()
            self._pf_seconds += time.thread_time() - t0
            self._pf_done = a + n
        return True

    def _pf_target(self) -> int:
        """Bytes from the slab's start that the prefault keeps populated."""
        pb = self.geom.page_bytes
        return min(self._fresh * pb + self._pf_window, self.capacity * pb)

    def _prefault_loop(self) -> None:
        if not self._prefault_to(self._pf_target()):
            with self._pf_cv:
                self._pf_busy = False
                self._pf_cv.notify_all()
            return
        while True:
            with self._pf_cv:
                self._pf_busy = False
                self._pf_cv.notify_all()
                self._pf_cv.wait_for(lambda: self._pf_stop or self._pf_done < self._pf_target())
                if self._pf_stop:
                    return
                self._pf_busy = True
                want = self._pf_target()
            if not self._prefault_to(want):
                with self._pf_cv:
                    self._pf_busy = False
                    self._pf_cv.notify_all()
                return

    def prefault_idle(self, timeout: float) -> bool:
        """Wait until the prefault thread has caught up (True), at most ``timeout`` seconds."""
        with self._pf_cv:
            return self._pf_cv.wait_for(
                lambda: self._pf_thread is None or self._pf_window == 0 or not self._pf_thread.is_alive()
                or (not self._pf_busy and self._pf_done >= self._pf_target()), timeout)

    @property
    def prefault_seconds(self) -> float:
        """CPU time the prefault thread spent zeroing slots ahead of the fill so far (at creation and
        in the background)."""
        return self._pf_seconds

    def prefix(self, keys: Sequence[str]) -> int:
        """Number of leading ``keys`` stored."""
        with self._lock:
            if not self.writer:
                self._replay()
            idx = self._index
            n = 0
            for k in keys:
                if k not in idx:
                    break
                n += 1
            return n

    def __contains__(self, key: str) -> bool:
        return self.prefix([key]) == 1

    def __len__(self) -> int:
        return len(self._index)

    def put(self, keys: Sequence[str], pages: np.ndarray, host: kvx.PreparedList) -> list[bool]:
        """Store host pages ``pages`` under ``keys`` (already stored keys are touched)."""
        if not self.writer:
            raise UsageError("this slab is read-only here (another rank writes it)")
        for k in keys:
            if not isinstance(k, str) or not k or len(k) > MAX_KEY:
                raise UsageError(f"bad page key {k!r}: a non-empty str of at most {MAX_KEY} characters")
        new_i: list[int] = []
        slots: list[int] = []
        with self._lock:
            batch = set(keys)
            seen: set[str] = set()
            for i, k in enumerate(keys):
                if k in self._index:
                    self._index.move_to_end(k)
                    continue
                if k in seen:
                    continue  # the same key twice in one batch: store it once
                seen.add(k)
                if not self._free:
                    victim = next((v for v in self._index if v not in batch), None)
                    if victim is None:
                        break  # the batch alone overflows the slab: store what fits
                    slot, _ = self._index.pop(victim)
                    self._append([[_DEL, victim, slot, 0]])
                    self._free.append(slot)
                slots.append(self._free.pop())
                new_i.append(i)
            if slots and max(slots) >= self._fresh:
                self._fresh = max(slots) + 1  # the prefault thread is woken once the batch is written
            claim = self._pf_claim
        ok = [k in self._index for k in keys]
        if not new_i:
            return ok
        try:
            if claim is not None:
                self._wait_claim(claim, slots)
            sums = self._write(pages[new_i], np.asarray(slots, dtype=np.int64), host)
        except BaseException:
            with self._lock:
                self._free.extend(slots)
            raise
        finally:
            if self._pf_thread is not None:  # top the window up now, not while this batch was copied
                with self._pf_cv:
                    self._pf_cv.notify_all()
        with self._lock:
            recs = []
            for i, slot, c in zip(new_i, slots, sums.tolist()):
                self._index[keys[i]] = (slot, c)
                recs.append([_PUT, keys[i], slot, c])
            self._append(recs)
            return [k in self._index for k in keys]

    def _wait_claim(self, claim: tuple[int, int], slots: list[int]) -> None:
        """Wait until the prefault step over ``claim`` (bytes) has ended if it covers one of ``slots``
        (it started before they were handed out; later steps start above them)."""
        pb = self.geom.page_bytes
        a, b = claim
        if not any(s * pb < b and (s + 1) * pb > a for s in slots):
            return
        with self._pf_cv:
            if not self._pf_cv.wait_for(lambda: self._pf_claim is not claim, self.timeout):
                raise kvx.TransferTimeout(f"slab {self.slab_path}: a prefault step did not end in {self.timeout} s")

    def _write(self, pages: np.ndarray, slots: np.ndarray, host: kvx.PreparedList) -> np.ndarray:
        """Write host ``pages`` into ``slots``; their checksums, in order.

        With a :class:`PwritevWriter`: two transfers of alternating slots, so that no two pages
        of one transfer are adjacent in the file and each page is one ``pwritev`` of its
        fragments (the kernel sizes the page-cache folios it allocates by the write).
        """
        g = self.geom
        fill = self._fill
        if fill is None:
            self.agent.write(host, g.frag_index(pages), self._plist, g.frag_index(slots)).wait(self.timeout)
            return self.digest(pages)
        xs = []
        for parity in (0, 1):
            sel = slots % 2 == parity
            if sel.any():
                xs.append(fill.agent.write(fill.host, g.frag_index(pages[sel]), self._fill_plist,
                                           g.frag_index(slots[sel])))
        for x in xs:
            x.wait(self.timeout)
        return fill.digest(pages)

    def get(self, keys: Sequence[str], pages: np.ndarray, host: kvx.PreparedList) -> list[bool]:
        """Read the stored prefix of ``keys`` into host pages ``pages``; verify each page.

        Returns one flag per key: True where the page is now in the host pool, checksum
        verified. A page that fails its checksum is dropped from the index (a miss).
        """
        with self._lock:
            if not self.writer:
                self._replay()
            found: list[tuple[int, int]] = []
            for k in keys:
                v = self._index.get(k)
                if v is None:
                    break
                if self.writer:
                    self._index.move_to_end(k)
                found.append(v)
        n = len(found)
        ok = [False] * len(keys)
        if n == 0:
            return ok
        slots = np.fromiter((s for s, _ in found), dtype=np.int64, count=n)
        # all reads go out at once, in chunks; each chunk is checked as soon as it has landed,
        # while the native threads still read the next ones
        bounds = list(range(0, n, max(1, -(-n // self.chunks)))) + [n]
        xs = [self.agent.read(host, self.geom.frag_index(pages[a:b]), self._plist,
                              self.geom.frag_index(slots[a:b])) for a, b in zip(bounds, bounds[1:])]
        parts = []
        for x, a, b in zip(xs, bounds, bounds[1:]):
            x.wait(self.timeout)
            parts.append(self.digest(pages[a:b]))
        sums = np.concatenate(parts)
        bad: list[int] = []
        for i, ((slot, want), got) in enumerate(zip(found, sums.tolist())):
            if want == got:
                ok[i] = True
            else:
                bad.append(i)
        if bad:
            with self._lock:
                for i in bad:
                    cur = self._index.get(keys[i])
                    if cur is not None and cur == found[i]:
                        log.warning("page %s failed its checksum: dropped", keys[i])
                        del self._index[keys[i]]
                        if self.writer:
                            self._append([[_DEL, keys[i], cur[0], 0]])
                            self._free.append(cur[0])
        return ok

    def delete(self, keys: Sequence[str]) -> int:
        n = 0
        with self._lock:
            for k in keys:
                cur = self._index.pop(k, None)
                if cur is not None:
                    self._append([[_DEL, k, cur[0], 0]])
                    self._free.append(cur[0])
                    n += 1
        return n

    def clear(self) -> None:
        """Forget every page (the slab's bytes stay until overwritten)."""
        with self._lock:
            if not self.writer:
                return
            self._index.clear()
            self._free = list(range(self.capacity - 1, -1, -1))
            self._compact()  # an empty journal in a new file: readers start over too

    def close(self) -> None:
        t = self._pf_thread
        if t is not None:
            with self._pf_cv:
                self._pf_stop = True
                self._pf_cv.notify_all()
            t.join(self.timeout)  # it stops after at most one step
            self._pf_thread = None
        if self._pf_fd >= 0 and (t is None or not t.is_alive()):
            os.close(self._pf_fd)
            self._pf_fd = -1
        with self._lock:
            if self._log is not None:
                self._log.close()
                self._log = None
            for reg in (self._reg, self._fill_reg):
                if reg is None:
                    continue
                try:
                    reg.release()
                except kvx.KVXError:
                    log.debug("slab release", exc_info=True)
