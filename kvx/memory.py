"""What memory is and how it is described: MemoryKind, regions, DescList, alloc_host."""

from __future__ import annotations

import enum
import mmap
import os
import re
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Sequence, Union

import msgpack
import numpy as np

from . import _args
from .errors import (
    ArgumentTypeError,
    ArgumentValueError,
    BackendUnavailable,
    IndexOutOfRange,
    ProtocolError,
    RegistrationError,
)

if TYPE_CHECKING:
    from .agent import Registration

__all__ = [
    "MemoryKind",
    "DescList",
    "FileRegion",
    "ObjectRegion",
    "RawRegion",
    "Region",
    "alloc_host",
    "regions_of",
]

_U64 = np.dtype("<u8")
WIRE_VERSION = 1


class MemoryKind(enum.IntEnum):
    """The kinds of memory kvx moves between."""

    HOST = 0
    CUDA = 1
    FILE = 2
    OBJECT = 3


def _kind(kind: Any, what: str) -> MemoryKind:
    """``kind`` (a MemoryKind or its int value; never a bool) as a MemoryKind."""
    if isinstance(kind, (bool, np.bool_)) or not isinstance(kind, (int, np.integer)):
        raise ArgumentTypeError(f"{what} must be a kvx.MemoryKind, not {type(kind).__name__}")
    try:
        return MemoryKind(int(kind))
    except ValueError:
        raise ArgumentValueError(f"{what} must be a kvx.MemoryKind (HOST, CUDA, FILE, OBJECT), not {kind!r}") from None


@dataclass(frozen=True, slots=True)
class FileRegion:
    """A file (created if absent, preallocated to ``nbytes``) registered as storage.

    Blocks may sit at any offset inside it.

    Parameters
    ----------
    path
        A str or ``os.PathLike`` (non-empty, no NUL characters).
    nbytes
        Size in bytes, from 1 to ``2**62``.

    Raises
    ------
    ArgumentTypeError, ArgumentValueError
        (both ``kvx.UsageError``) for an argument of the wrong type or out of range.
    """

    path: str
    nbytes: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", _args.path(self.path, "FileRegion path"))
        object.__setattr__(self, "nbytes", _args.size(self.nbytes, "FileRegion nbytes"))


@dataclass(frozen=True, slots=True)
class ObjectRegion:
    """One object in an object store; written whole, read whole or by byte range.

    Parameters
    ----------
    bucket, key
        Non-empty strs; the key at most 1024 bytes of UTF-8 (S3's limit).
    nbytes
        Size in bytes, from 1 to ``2**62``.

    Raises
    ------
    ArgumentTypeError, ArgumentValueError
        (both ``kvx.UsageError``) for an argument of the wrong type or out of range.
    """

    bucket: str
    key: str
    nbytes: int

    def __post_init__(self) -> None:
        _args.name(self.bucket, "ObjectRegion bucket")
        _args.name(self.key, "ObjectRegion key")
        try:
            klen = len(self.key.encode())
        except UnicodeEncodeError:
            raise ArgumentValueError(f"ObjectRegion key must be valid UTF-8, not {self.key!r:.80}") from None
        if klen > 1024:
            raise ArgumentValueError(f"ObjectRegion key must be at most 1024 bytes of UTF-8, not {klen}")
        object.__setattr__(self, "nbytes", _args.size(self.nbytes, "ObjectRegion nbytes"))


@dataclass(frozen=True, slots=True)
class RawRegion:
    """Memory given by address: ``RawRegion(addr, nbytes, MemoryKind.CUDA, dev=1)``.

    The caller keeps the memory alive for as long as it is registered.

    Parameters
    ----------
    addr
        Address, from 1 to ``2**63 - 1``; ``addr + nbytes`` at most ``2**63``.
    nbytes
        Length in bytes, from 1 to ``2**62``.
    kind
        ``MemoryKind.HOST`` or ``MemoryKind.CUDA``.
    dev
        The CUDA device (0 for HOST), from 0 to ``2**31 - 1``.

    Raises
    ------
    ArgumentTypeError, ArgumentValueError
        (both ``kvx.UsageError``) for an argument of the wrong type or out of range.
    """

    addr: int
    nbytes: int
    kind: MemoryKind = MemoryKind.HOST
    dev: int = 0

    def __post_init__(self) -> None:
        addr = _args.integer(self.addr, "RawRegion addr", 1, (1 << 63) - 1)
        nbytes = _args.size(self.nbytes, "RawRegion nbytes")
        if addr + nbytes > 1 << 63:
            raise ArgumentValueError(f"RawRegion addr + nbytes must be at most 2**63, not 0x{addr + nbytes:x}")
        kind = _kind(self.kind, "RawRegion kind")
        if kind not in (MemoryKind.HOST, MemoryKind.CUDA):
            raise ArgumentValueError("RawRegion describes HOST or CUDA memory; use FileRegion/ObjectRegion")
        dev = _args.integer(self.dev, "RawRegion dev", 0, (1 << 31) - 1)
        for f, v in (("addr", addr), ("nbytes", nbytes), ("kind", kind), ("dev", dev)):
            object.__setattr__(self, f, v)


@dataclass(frozen=True, slots=True)
class Region:
    """One contiguous piece of registered memory, as the agent keeps it.

    ``addr`` is a virtual address (HOST, CUDA) or 0 (FILE, OBJECT: offsets start at 0);
    ``dev`` is the CUDA device, or the file/object id the agent assigned.
    """

    kind: MemoryKind
    addr: int
    nbytes: int
    dev: int
    owner: Any = None  # keeps the memory alive; not compared
    shm: tuple[int, int, int] | None = None  # (fd, offset inside the memfd, memfd size) if shareable
    path: str | None = None  # FILE
    bucket: str | None = None  # OBJECT
    key: str | None = None  # OBJECT


# ---------------------------------------------------------------------------------------------
# alloc_host: memfd-backed memory that other local processes can map.

_ALLOCS_LOCK = threading.Lock()
_ALLOCS: dict[int, tuple[int, int]] = {}  # start address -> (fd, size)
_ALLOC_STARTS: list[int] = []


def _forget_alloc(addr: int, fd: int) -> None:
    # runs when the mmap object is collected (it unmaps itself): forget the block, close its fd
    with _ALLOCS_LOCK:
        _ALLOCS.pop(addr, None)
        try:
            _ALLOC_STARTS.remove(addr)
        except ValueError:
            pass
    try:
        os.close(fd)
    except OSError:
        pass


def alloc_host(nbytes: int, pinned: bool = False) -> np.ndarray:
    """Allocate host memory that other local processes can map (the fast same-node path).

    Parameters
    ----------
    nbytes
        Size in bytes, from 1 to ``2**62``. The memory is zero-filled and page aligned.
    pinned
        Also page-lock it and register it with CUDA so GPUs reach it directly. Needs a CUDA
        runtime (``pip install kvx[cuda]``).

    Returns
    -------
    numpy.ndarray
        A writable ``uint8`` array of ``nbytes`` elements. Keep it (or a view of it) alive while
        it is in use; views of it registered with an agent share the fast path too.

    Raises
    ------
    ArgumentTypeError, ArgumentValueError
        (both ``kvx.UsageError``) for an argument of the wrong type or out of range.
    RegistrationError
        If the system cannot provide the memory.
    """
    nbytes = _args.size(nbytes, "alloc_host nbytes")
    pinned = _args.flag(pinned, "alloc_host pinned")
    if pinned:
        from . import _cuda

        _cuda.require_runtime("alloc_host(pinned=True)")
    fd = os.memfd_create("kvx-host", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as exc:
        os.close(fd)
        raise RegistrationError(f"cannot allocate {nbytes} bytes of shareable host memory: {exc}") from exc
    arr = np.frombuffer(mm, dtype=np.uint8)
    addr = int(arr.ctypes.data)
    with _ALLOCS_LOCK:
        _ALLOCS[addr] = (fd, nbytes)
        import bisect

        bisect.insort(_ALLOC_STARTS, addr)
    # the finalizer must not hold ``mm`` itself, or the memory would live until exit
    weakref.finalize(mm, _forget_alloc, addr, fd)
    if pinned:
        from . import _cuda

        _cuda.pin_host(addr, nbytes)
        weakref.finalize(mm, _cuda.unpin_host, addr)
    return arr


def shm_of(addr: int, nbytes: int) -> tuple[int, int, int] | None:
    """Return ``(fd, offset, size)`` if ``[addr, addr+nbytes)`` lies inside one alloc_host block."""
    import bisect

    with _ALLOCS_LOCK:
        i = bisect.bisect_right(_ALLOC_STARTS, addr) - 1
        if i < 0:
            return None
        start = _ALLOC_STARTS[i]
        fd, size = _ALLOCS[start]
    if addr + nbytes <= start + size:
        return fd, addr - start, size
    return None


# ---------------------------------------------------------------------------------------------
# Turning user objects into regions.

Registrable = Union[np.ndarray, memoryview, bytearray, FileRegion, ObjectRegion, RawRegion, Any]


def _host_region(addr: int, nbytes: int, owner: Any) -> Region:
    return Region(MemoryKind.HOST, addr, nbytes, 0, owner=owner, shm=shm_of(addr, nbytes))


def _refuse_objects(dtype: np.dtype[Any]) -> None:
    # an object array holds PyObject pointers and reference counts: a peer writing into it (or a
    # read out of it) would leave the interpreter following forged pointers
    if dtype.hasobject:
        raise RegistrationError(f"cannot register memory holding Python objects (dtype {dtype}); "
                                "register plain data (e.g. uint8, float16) only")


_FIELD_NAMES = re.compile(r":[^:]*:")


def _refuse_object_buffer(mv: memoryview) -> None:
    """Refuse a buffer whose format (PEP 3118) has Python-object items, whoever exports it."""
    try:
        dtype = np.asarray(mv).dtype
    except (TypeError, ValueError, RuntimeError):  # a format numpy cannot read: look for 'O' items
        if "O" in _FIELD_NAMES.sub("", mv.format):
            raise RegistrationError(f"cannot register memory holding Python objects (format {mv.format!r})") from None
        return
    _refuse_objects(dtype)


def _one_region(obj: Any) -> Region:
    if isinstance(obj, (FileRegion, ObjectRegion)):
        raise AssertionError("handled by the agent")
    if isinstance(obj, RawRegion):
        if obj.kind == MemoryKind.HOST:
            return _host_region(obj.addr, obj.nbytes, obj)
        return Region(MemoryKind.CUDA, obj.addr, obj.nbytes, obj.dev, owner=obj)
    mod = type(obj).__module__ or ""
    if mod.startswith("torch") and hasattr(obj, "data_ptr"):
        if not obj.is_contiguous():
            raise RegistrationError("cannot register a non-contiguous torch tensor")
        nbytes = obj.numel() * obj.element_size()
        if nbytes == 0:
            raise RegistrationError("cannot register an empty tensor")
        if obj.device.type == "cpu":
            return _host_region(int(obj.data_ptr()), nbytes, obj)
        if obj.device.type == "cuda":
            return Region(MemoryKind.CUDA, int(obj.data_ptr()), nbytes, int(obj.device.index or 0), owner=obj)
        raise RegistrationError(f"cannot register a tensor on device {obj.device}")
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        from . import _cuda

        ptr, nbytes, dev = _cuda.region_from_cai(cai)
        return Region(MemoryKind.CUDA, ptr, nbytes, dev, owner=obj)
    if isinstance(obj, np.ndarray):
        arr = obj
        _refuse_objects(arr.dtype)
    else:
        try:
            mv = memoryview(obj)
        except TypeError:
            raise RegistrationError(
                f"cannot register {type(obj).__name__}: expected an array, buffer, tensor, "
                "FileRegion, ObjectRegion, RawRegion or a list of these"
            ) from None
        _refuse_object_buffer(mv)
        if not mv.contiguous:
            raise RegistrationError("cannot register a non-contiguous buffer")
        if mv.readonly:
            raise RegistrationError("cannot register read-only memory (peers may write to it)")
        arr = np.frombuffer(mv, dtype=np.uint8) if mv.nbytes else np.empty(0, np.uint8)
    if not arr.flags.c_contiguous:
        raise RegistrationError("cannot register a non-contiguous array")
    if not arr.flags.writeable:
        raise RegistrationError("cannot register a read-only array (peers may write to it)")
    if arr.nbytes == 0:
        raise RegistrationError("cannot register empty memory")
    return _host_region(int(arr.ctypes.data), int(arr.nbytes), obj)


def regions_of(obj: Registrable) -> list[Any]:
    """Flatten ``obj`` (one registrable or a list/tuple of them) into Regions / storage regions."""
    items: Sequence[Any] = obj if isinstance(obj, (list, tuple)) else [obj]
    if len(items) == 0:
        raise RegistrationError("nothing to register: empty list")
    out: list[Any] = []
    for it in items:
        if isinstance(it, (list, tuple)):
            raise RegistrationError("nested lists cannot be registered; pass a flat list")
        if isinstance(it, (FileRegion, ObjectRegion)):
            out.append(it)
        else:
            out.append(_one_region(it))
    return out


# ---------------------------------------------------------------------------------------------
# DescList


def _per_address(arr: np.ndarray, what: str, a: np.ndarray) -> np.ndarray:
    """``arr`` (one value, or one per address of ``a``) broadcast to ``a``'s shape."""
    if arr.ndim == 1 and arr.shape != a.shape:
        raise ArgumentValueError(f"{what} must be one int or hold one per address ({a.shape[0]}), "
                                 f"not {arr.shape[0]}")
    return np.broadcast_to(arr, a.shape)


def _as_u64(a: Any, name: str, *, scalar: bool = False) -> np.ndarray:
    """``a`` as a 1-D ``uint64`` array (a 0-d one too with ``scalar``); vectorised checks only."""
    if isinstance(a, (str, bytes, bytearray, memoryview)) or a is None:
        raise ArgumentTypeError(f"{name} must be an array or list of integers, not {type(a).__name__}")
    try:
        arr = np.asarray(a)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ArgumentTypeError(f"{name} is not an array of integers: {exc}") from None
    if arr.dtype.kind in "fO" and isinstance(a, (list, tuple)) and all(
            isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_)) for x in a):
        # Python ints on both sides of 2**63 (or past 2**64) come out of numpy as float64 or
        # objects; such a list is Python objects already, so take its ints one by one
        if not all(0 <= int(x) < 1 << 64 for x in a):
            raise ArgumentValueError(f"{name} values must be from 0 to 2**64 - 1")
        arr = np.array([int(x) for x in a], dtype=_U64)
    if arr.ndim != 1 and not (scalar and arr.ndim == 0):
        raise ArgumentValueError(f"{name} must be one-dimensional, not of shape {arr.shape}")
    if arr.dtype != _U64:
        if arr.size and arr.dtype.kind not in "iu":
            raise ArgumentTypeError(f"{name} must hold integers (0 to 2**64 - 1), not {arr.dtype}")
        if arr.size and arr.dtype.kind == "i" and (arr < 0).any():
            raise ArgumentValueError(f"{name} has negative values")
        arr = arr.astype(_U64)
    return arr


def _check_descs(a: np.ndarray, n: np.ndarray, d: np.ndarray) -> None:
    if n.shape != a.shape or d.shape != a.shape:
        raise ArgumentValueError(f"addr, nbytes and dev must have one length each ({a.shape}, {n.shape}, {d.shape})")
    if n.size and int(n.min()) == 0:
        raise ArgumentValueError("descriptors must have nbytes > 0")
    if a.size and (int(a.max()) > (1 << 63) or int(n.max()) > (1 << 62)):
        raise ArgumentValueError("descriptor address or length out of range (addr at most 2**63, nbytes 2**62)")


#: bounds on a strided descriptor: pieces per descriptor, and its stride
MAX_COUNT = 1 << 32
MAX_STRIDE = 1 << 48


def _strided_problem(n: np.ndarray, c: np.ndarray, s: np.ndarray) -> str | None:
    """Why ``(nbytes, count, stride)`` arrays do not describe strided descriptors (None: they do)."""
    if c.shape != n.shape or s.shape != n.shape:
        return f"count and stride must hold one value per descriptor ({n.shape[0]}), not {c.shape} and {s.shape}"
    if not n.size:
        return None
    if int(c.min()) == 0 or int(c.max()) > MAX_COUNT:
        return f"count must be from 1 to {MAX_COUNT}"
    if int(s.max()) > MAX_STRIDE:
        return f"stride must be at most {MAX_STRIDE}"
    many = c > 1
    if many.any() and (s[many] < n[many]).any():
        return "a strided descriptor's stride must be at least its nbytes (pieces may not overlap)"
    # the span ((count - 1) * stride + nbytes) stays below 2**62: no wrap in any check built on it
    if (float(((c.astype(np.float64) - 1) * s.astype(np.float64) + n.astype(np.float64)).max()) > float(1 << 62)):
        return "a strided descriptor spans more than 2**62 bytes"
    return None


class DescList:
    """Descriptors of one memory kind: three parallel ``uint64`` arrays.

    ``addr`` is the address (HOST, CUDA) or byte offset (FILE, OBJECT), ``nbytes`` the length,
    ``dev`` the CUDA device or the file/object id. Indexing by slices gives views; by integer
    arrays, gathered copies. The constructor checks its arrays as :meth:`from_arrays` does
    (non-negative integers, lengths > 0, in range; ``UsageError`` otherwise); the attributes are
    read-only.

    A *strided* list (:meth:`strided`) describes a regular pattern once per descriptor: ``count``
    pieces of ``nbytes`` bytes each, the k-th at ``addr + k * stride`` (a head slice of every
    token of a block, say). Such a descriptor pairs with one of equal ``nbytes`` and ``count``
    (strides may differ); backends that cannot move it natively see it expanded into its pieces.
    For a plain list ``count`` is all ones and ``stride`` all zeros.
    """

    __slots__ = ("_addr", "_count", "_dev", "_kind", "_nbytes", "_stride")

    def __init__(self, kind: MemoryKind, addr: np.ndarray, nbytes: np.ndarray, dev: np.ndarray) -> None:
        k = _kind(kind, "DescList kind")
        a, n, d = _as_u64(addr, "addr"), _as_u64(nbytes, "nbytes"), _as_u64(dev, "dev")
        _check_descs(a, n, d)
        self._kind, self._addr, self._nbytes, self._dev = k, a, n, d
        self._count: np.ndarray | None = None
        self._stride: np.ndarray | None = None

    @classmethod
    def _wrap(cls, kind: MemoryKind, addr: np.ndarray, nbytes: np.ndarray, dev: np.ndarray,
              count: np.ndarray | None = None, stride: np.ndarray | None = None) -> "DescList":
        # arrays already checked (or derived from checked ones): no second pass over them
        self = cls.__new__(cls)
        self._kind, self._addr, self._nbytes, self._dev = kind, addr, nbytes, dev
        self._count, self._stride = count, stride
        return self

    @classmethod
    def strided(cls, *, kind: MemoryKind, addr: Any, nbytes: Any, count: Any, stride: Any,
                dev: Any = 0) -> "DescList":
        """Build a strided DescList: descriptor ``i`` is ``count[i]`` pieces of ``nbytes[i]`` bytes,
        piece ``k`` at ``addr[i] + k * stride[i]``. ``nbytes``, ``count``, ``stride`` and ``dev``
        may be scalars.

        Raises
        ------
        ArgumentTypeError, ArgumentValueError
            As :meth:`from_arrays`; also for a count of 0 or above ``2**32``, a stride above
            ``2**48``, a stride smaller than ``nbytes`` where ``count > 1`` (overlapping pieces),
            or a descriptor whose span reaches past ``2**63``.
        """
        base = cls.from_arrays(kind=kind, addr=addr, nbytes=nbytes, dev=dev)
        a = base._addr
        c = np.ascontiguousarray(_per_address(_as_u64(count, "count", scalar=True), "count", a))
        s = np.ascontiguousarray(_per_address(_as_u64(stride, "stride", scalar=True), "stride", a))
        why = _strided_problem(base._nbytes, c, s)
        if why is not None:
            raise ArgumentValueError(why)
        out = cls._wrap(base.kind, a, base._nbytes, base._dev, c, s)
        if a.size and int((a + out.span).max()) > (1 << 63):
            raise ArgumentValueError("a strided descriptor reaches past address 2**63")
        return out

    @property
    def is_strided(self) -> bool:
        """Whether the list carries counts and strides (see :meth:`strided`)."""
        return self._count is not None

    @property
    def count(self) -> np.ndarray:
        """Pieces per descriptor, ``uint64`` (all ones for a plain list)."""
        return self._count if self._count is not None else np.ones(self._addr.shape, dtype=_U64)

    @property
    def stride(self) -> np.ndarray:
        """Bytes from one piece's start to the next's, ``uint64`` (all zeros for a plain list)."""
        return self._stride if self._stride is not None else np.zeros(self._addr.shape, dtype=_U64)

    @property
    def span(self) -> np.ndarray:
        """Bytes from a descriptor's first byte to one past its last: ``(count - 1) * stride +
        nbytes`` (``nbytes`` for a plain list), ``uint64``: what must lie inside a registration."""
        c, s = self._count, self._stride
        if c is None or s is None:
            return self._nbytes
        return (c - np.uint64(1)) * s + self._nbytes

    @property
    def piece_bytes(self) -> np.ndarray:
        """Bytes each descriptor moves: ``count * nbytes``, ``uint64``."""
        return self._nbytes if self._count is None else self._count * self._nbytes

    def flatten(self) -> "DescList":
        """The same bytes as a plain list, one descriptor per piece, in order (itself if plain)."""
        if self._count is None or self._stride is None:
            return self
        c = self._count.astype(np.int64)
        total = int(c.sum())
        try:
            first = np.repeat(np.cumsum(c) - c, c)
            k = (np.arange(total, dtype=np.int64) - first).astype(_U64)
            addr = np.repeat(self._addr, c) + k * np.repeat(self._stride, c)
        except (MemoryError, ValueError):
            raise ArgumentValueError(f"{total} pieces are too many to describe one by one") from None
        return DescList._wrap(self._kind, addr, np.repeat(self._nbytes, c), np.repeat(self._dev, c))

    @property
    def kind(self) -> MemoryKind:
        """The memory kind of every descriptor."""
        return self._kind

    @property
    def addr(self) -> np.ndarray:
        """Addresses (HOST, CUDA) or byte offsets (FILE, OBJECT), ``uint64``."""
        return self._addr

    @property
    def nbytes(self) -> np.ndarray:
        """Lengths in bytes, ``uint64``."""
        return self._nbytes

    @property
    def dev(self) -> np.ndarray:
        """CUDA device or file/object id, ``uint64``."""
        return self._dev

    @classmethod
    def from_arrays(cls, *, kind: MemoryKind, addr: Any, nbytes: Any, dev: Any = 0) -> "DescList":
        """Build a DescList from array-likes; ``nbytes`` and ``dev`` may be scalars.

        Raises
        ------
        ArgumentTypeError, ArgumentValueError
            (both ``kvx.UsageError``) for arrays of non-integers, negative or out-of-range
            values, zero lengths, or ``nbytes``/``dev`` arrays of another length than ``addr``.
        """
        k = _kind(kind, "DescList kind")
        a = _as_u64(addr, "addr")
        n = _per_address(_as_u64(nbytes, "nbytes", scalar=True), "nbytes", a)
        d = _per_address(_as_u64(dev, "dev", scalar=True), "dev", a)
        _check_descs(a, n, d)
        return cls._wrap(k, a, np.ascontiguousarray(n), np.ascontiguousarray(d))

    @classmethod
    def blocks(cls, reg: "Registration | DescList", block_bytes: int) -> "DescList":
        """Carve equal blocks of ``block_bytes`` from every region of a registration.

        Each region contributes ``region_bytes // block_bytes`` blocks, in address order; a tail
        shorter than a block is left out. Vectorized: a million blocks take milliseconds.

        Parameters
        ----------
        reg
            A :class:`~kvx.Registration` (from ``Agent.register``) or a DescList.
        block_bytes
            Block size in bytes, from 1 to ``2**62``.
        """
        if isinstance(reg, DescList):
            base = reg
        elif isinstance(getattr(reg, "descs", None), DescList):  # a Registration (agent.py imports this module)
            base = reg.descs
        else:
            raise ArgumentTypeError(f"DescList.blocks takes a kvx.Registration or DescList, not {type(reg).__name__}")
        block_bytes = _args.size(block_bytes, "block_bytes")
        counts = (base.nbytes // np.uint64(block_bytes)).astype(np.int64)
        total = int(counts.sum())
        if total == 0:
            raise ArgumentValueError(f"no region of the registration holds a whole block of {block_bytes} bytes")
        try:
            starts = np.repeat(base.addr, counts)
            first = np.repeat(np.cumsum(counts) - counts, counts)
            offs = (np.arange(total, dtype=np.int64) - first).astype(_U64) * np.uint64(block_bytes)
            sizes = np.full(total, block_bytes, dtype=_U64)
        except (MemoryError, ValueError):  # numpy cannot hold that many descriptors
            raise ArgumentValueError(f"{total} blocks of {block_bytes} bytes are too many to describe; "
                                     "take larger blocks") from None
        return cls._wrap(base.kind, starts + offs, sizes, np.repeat(base.dev, counts))

    def __len__(self) -> int:
        return int(self.addr.shape[0])

    def __getitem__(self, idx: Any) -> "DescList":
        n = len(self)
        if isinstance(idx, np.ndarray) and idx.ndim == 0 and idx.dtype.kind in "iu":
            idx = idx[()]
        if isinstance(idx, (int, np.integer)) and not isinstance(idx, (bool, np.bool_)):
            i = int(idx)
            if not -n <= i < n:
                raise IndexOutOfRange(f"descriptor index {i} out of range for a list of {n}")
            i = i + n if i < 0 else i
            idx = slice(i, i + 1)
        elif isinstance(idx, slice):
            for v in (idx.start, idx.stop, idx.step):
                if v is not None and (isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer))):
                    raise ArgumentTypeError(f"DescList slice bounds must be ints or None, not {type(v).__name__}")
            if idx.step == 0:
                raise ArgumentValueError("DescList slice step cannot be zero")
        else:
            if idx is None or isinstance(idx, (str, bytes, bytearray, memoryview, bool, np.bool_)):
                raise ArgumentTypeError(f"index a DescList with ints, slices or int arrays, not {type(idx).__name__}")
            try:
                idx = np.asarray(idx)
            except (TypeError, ValueError, OverflowError) as exc:
                raise ArgumentTypeError(f"DescList indices must be integers: {exc}") from None
            if idx.dtype == bool:
                raise ArgumentTypeError("index a DescList with integers or slices, not booleans")
            if idx.size and idx.dtype.kind not in "iu":
                raise ArgumentTypeError(f"DescList indices must be integers, not {idx.dtype}")
            if idx.ndim != 1:
                raise ArgumentValueError(f"DescList indices must be one-dimensional, not of shape {idx.shape}")
            if not idx.size:
                idx = idx.astype(np.intp)
            elif int(idx.max()) >= n or int(idx.min()) < -n:
                raise IndexOutOfRange(f"descriptor index out of range for a list of {n}")
        if self._count is not None and self._stride is not None:
            return DescList._wrap(self._kind, self._addr[idx], self._nbytes[idx], self._dev[idx], self._count[idx],
                                  self._stride[idx])
        return DescList._wrap(self._kind, self._addr[idx], self._nbytes[idx], self._dev[idx])

    def __iter__(self) -> Iterable[tuple[int, int, int]]:  # type: ignore[override]
        return iter(zip(self.addr.tolist(), self.nbytes.tolist(), self.dev.tolist()))

    def __repr__(self) -> str:
        tot = int(self.piece_bytes.sum()) if len(self) else 0
        strided = ", strided" if self._count is not None else ""
        return f"DescList({self.kind.name}, n={len(self)}, bytes={tot}{strided})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DescList):
            return NotImplemented
        return (
            self.kind == other.kind
            and np.array_equal(self.addr, other.addr)
            and np.array_equal(self.nbytes, other.nbytes)
            and np.array_equal(self.dev, other.dev)
            and self.is_strided == other.is_strided
            and np.array_equal(self.count, other.count)
            and np.array_equal(self.stride, other.stride)
        )

    __hash__ = None  # type: ignore[assignment]

    @property
    def total_bytes(self) -> int:
        """Sum of the bytes the descriptors move (``count * nbytes`` each)."""
        return int(self.piece_bytes.sum())

    def to_bytes(self) -> bytes:
        """Serialize for a peer (versioned msgpack; see :meth:`from_bytes`)."""
        msg = {
            "v": WIRE_VERSION,
            "t": "descs",
            "kind": int(self.kind),
            "n": len(self),
            "addr": np.ascontiguousarray(self.addr, _U64).tobytes(),
            "nbytes": np.ascontiguousarray(self.nbytes, _U64).tobytes(),
            "dev": np.ascontiguousarray(self.dev, _U64).tobytes(),
        }
        if self._count is not None:
            msg["count"] = np.ascontiguousarray(self._count, _U64).tobytes()
            msg["stride"] = np.ascontiguousarray(self._stride, _U64).tobytes()
        return msgpack.packb(msg, use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes, *, max_bytes: int | None = None) -> "DescList":
        """Parse :meth:`to_bytes` output; anything malformed raises ``ProtocolError``."""
        from . import wire

        if max_bytes is not None:
            max_bytes = _args.size(max_bytes, "from_bytes max_bytes")
        msg = wire.unpack(data, max_bytes=max_bytes)
        wire.check(msg, "descs", {"kind": int, "n": int, "addr": bytes, "nbytes": bytes, "dev": bytes})
        n = msg["n"]
        try:
            kind = MemoryKind(msg["kind"])
        except ValueError:
            raise ProtocolError(f"unknown memory kind {msg['kind']!r}") from None
        if n < 0 or any(len(msg[k]) != 8 * n for k in ("addr", "nbytes", "dev")):
            raise ProtocolError("descriptor arrays do not match the declared count")
        arrs = [np.frombuffer(msg[k], dtype=_U64).copy() for k in ("addr", "nbytes", "dev")]
        if n and (int(arrs[1].min()) == 0 or int(arrs[0].max()) > (1 << 63) or int(arrs[1].max()) > (1 << 62)):
            raise ProtocolError("descriptor with zero length or out-of-range address")
        if "count" not in msg and "stride" not in msg:
            return cls._wrap(kind, *arrs)
        cs = [msg.get(k) for k in ("count", "stride")]
        if not all(isinstance(v, bytes) and len(v) == 8 * n for v in cs):
            raise ProtocolError("strided descriptor arrays do not match the declared count")
        c, s = (np.frombuffer(v, dtype=_U64).copy() for v in cs)  # type: ignore[arg-type]
        why = _strided_problem(arrs[1], c, s)
        out = cls._wrap(kind, arrs[0], arrs[1], arrs[2], c, s)
        if why is None and n and int((arrs[0] + out.span).max()) > (1 << 63):
            why = "a strided descriptor reaches past address 2**63"
        if why is not None:
            raise ProtocolError(f"malformed strided descriptors: {why}")
        return out


def require_torch(feature: str) -> Any:
    """Import torch or raise BackendUnavailable naming the extra."""
    try:
        import torch
    except ImportError as exc:
        raise BackendUnavailable(f"{feature} needs PyTorch: pip install kvx[torch]") from exc
    return torch
