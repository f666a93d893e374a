"""``posix``: host memory <-> files with positional vectored I/O on a native thread pool.

A :class:`kvx.FileRegion` registration opens (creating it if absent, mode 0600) and preallocates
the file once, and keeps its descriptor for the life of the registration. Descriptors of a FILE
list carry the byte offset as ``addr`` and the registration slot as ``dev``; preparing a list
turns the slots into a per-descriptor fd array (``fd_table[slots]``, vectorized).

A transfer is one native job: the pairs are sorted by file offset (numpy, vectorized) so that
blocks that are adjacent in the file -- whatever their order in the request -- coalesce into
``pwritev``/``preadv`` calls of up to ``IOV_MAX`` iovecs, and the sorted list is cut into one
byte-balanced range per thread of a pthread pool that runs with the GIL released. Transfers of
at most ``KVX_INLINE_BYTES`` run inline in the posting thread (lowest latency).

Buffered writes (memory -> file) go through a shared mapping of the file (``KVX_POSIX_MMAP``,
default on; ``PosixOptions(mmap=...)``): each file is mapped ``MAP_SHARED`` read-write at
registration and a write is the native copy into ``map + offset`` (``OP_MMWRITE``), each run of
adjacent blocks first faulted in writable with ``madvise(MADV_POPULATE_WRITE)``. ``pwritev``
into one file serializes on the inode lock (about 5-6 GB/s here whatever the thread count);
page faults on a shared mapping do not, and dirty pages already mapped writable cost nothing.
One exception: a run with a page that is not in the page cache (``mincore``) where the file has
data on disk (``lseek(SEEK_DATA)``) goes through ``pwritev``, since a write fault would read that
page from the disk first and ``pwrite`` of whole pages does not (2x slower otherwise; never
written preallocated pages fault in as zeros, without I/O, and take the mapping). A file that
cannot be mapped stays on ``pwritev``. Buffered reads of a mapped file copy out of the mapping
too (``OP_MMREAD``): a run of adjacent blocks in the page cache (probed on its first, middle
and last page with ``mincore``) is copied with the native streaming copy straight out of the
mapping, whose read faults map the cached pages many at a time (faster than ``preadv``, which
looks up and copies page by page into cached destination lines; nothing is populated ahead:
``MADV_POPULATE_READ`` walks every page, mapped or not); a run found not cached goes through
``preadv``. A page the file no longer backs (truncated or punched under the registration, disk
full) fails a write's populate with EFAULT, or raises SIGBUS in the copy, which the native guard
catches: the transfer turns FAILED with a TransferError that says which (see
:meth:`PosixBackend._translate`).

``O_DIRECT`` (``KVX_POSIX_DIRECT=1`` or ``PosixOptions(direct=True)``):
each file is opened a second time with ``O_DIRECT``. Per descriptor:

- file offset, length and memory address all 4096-aligned: straight ``pwritev``/``preadv`` on
  the direct descriptor from the caller's memory (zero copy);
- file range aligned, memory not: through page-aligned (mmap'd) bounce buffers -- the native
  memcpy gathers into the bounce and the pool writes it with ``O_DIRECT`` (reads the reverse),
  double-buffered so that copying one chunk overlaps the I/O of the previous one;
- file range not 4096-aligned: through the ordinary (buffered) descriptor.
  O_DIRECT jobs are split over at least 4 pool threads (they wait on the device, not the CPU). Linux keeps the two
  coherent (direct I/O writes back and invalidates the page cache over its range), but those
  blocks do go through the page cache.

Durability (``KVX_POSIX_SYNC`` or ``PosixOptions(sync=...)``) -- what a DONE write guarantees:

- ``none``: the bytes are in the kernel (page cache, or handed to the device under O_DIRECT):
  every reader of the file on this machine sees them and they survive the process dying, but
  not a kernel crash or power loss.
- ``data``: after all writes of the transfer succeeded, ``fdatasync`` ran on every file it
  touched: data and the metadata needed to read it back (size, allocated extents) are on stable
  storage, as far as the device honours cache flushes.
- ``full``: the same with ``fsync`` (inode metadata such as mtime too).

In ``data``/``full`` mode a registration that creates a file also fsyncs it and its directory.
A FAILED write guarantees nothing about the blocks it covered (some may hold new bytes).

Release is final: every job carries a guard per registration slot it touches (the slot's
``generation << 1 | live`` word and an in-flight counter, checked natively before any byte
moves); ``deregister`` clears the word and waits for the counters to drain before it unmaps the
file and closes the descriptor, so neither is reused under a running transfer.
"""

from __future__ import annotations

from ... import _native
from .backend import PosixBackend, PosixOptions
from .files import ALIGN, ERRORS, SYNC_MODES, _sync_code, open_preallocated, translate_oserror

__all__ = ["ALIGN", "ERRORS", "SYNC_MODES", "PosixBackend", "PosixOptions", "_native", "_sync_code",
           "open_preallocated", "translate_oserror"]
