"""The cuda backend: GPU <-> GPU and GPU <-> pinned host, in one process and across two.

Everything that needs a GPU is marked ``gpu`` (``make gpu-check`` runs it on a GPU machine);
the first two tests run everywhere and check that the backend stays optional.

The shared ``TransferConformance`` suite runs here on GPU memory (``kvx.testing.memory`` specs:
across two GPUs, on one, to and from pinned host memory, into a PyTorch tensor): permuted ids,
index forms, forged descriptors, notifications after the data, a release racing transfers, a
killed peer, misuse after close. The tests below it cover what is the cuda backend's own: the
copy paths (kernel, copy engines, both at once), which GPU executes, the route, staging, waits.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import kvx
from kvx.testing.conformance import TransferConformance
from kvx.testing.gpu_peer import Helper, alloc, digest, pattern


def _reason() -> str | None:
    from kvx.backends.cuda import CudaBackend

    return CudaBackend.unavailable_reason()


# ---- everywhere -------------------------------------------------------------------------------


def test_import_does_not_pull_cupy_and_reason_is_clear() -> None:
    code = ("import sys, kvx, kvx.backends.cuda as c; assert 'cupy' not in sys.modules; "
            "r = c.CudaBackend.unavailable_reason(); print(r)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    reason = out.stdout.strip()
    assert reason == "None" or "pip install kvx[cuda]" in reason or "no CUDA device" in reason


def test_pinned_alloc_without_cuda_raises_backend_unavailable() -> None:
    if _reason() is None:
        pytest.skip("CUDA is available here")
    with pytest.raises(kvx.BackendUnavailable, match="needs CUDA"):
        kvx.alloc_host(4096, pinned=True)


@pytest.fixture(params=[0, 2], ids=["one-thread", "helpers"])
def stage_mode(request: pytest.FixtureRequest) -> Any:
    """Large index arrays staged by the calling thread alone, or with the helper threads (forced even
    on machines with few CPUs)."""
    from kvx import _native

    prev = _native.stage_parallel(request.param)
    yield request.param
    _native.stage_parallel(prev)


def test_native_stage_index_checks_and_converts(stage_mode: int) -> None:
    """The post path's index staging (``_native.stage_index``): every index form, int32 and int64
    output, bounds (the message names the list whose index is out of range), pairing and buffer size
    checked; no GPU needed."""
    import ctypes

    from kvx import _native

    assert _native.stage_parallel() == stage_mode
    buf = (ctypes.c_uint8 * (1 << 20))()
    addr, cap = ctypes.addressof(buf), len(buf)
    raw = np.frombuffer(buf, dtype=np.uint8)
    n = 1 << 16
    li = np.arange(n, dtype=np.int64)
    ri = np.random.default_rng(3).permutation(n).astype(np.int64)
    for wide, dt in ((False, np.int32), (True, np.int64)):
        for a, b in ((li, ri), (li.astype(np.int32), ri.astype(np.uint32)), (li.astype(np.uint64), ri)):
            assert _native.stage_index(a, n, b, n, addr, cap, wide) == n
            got = raw[: 2 * n * np.dtype(dt).itemsize].view(dt)
            assert np.array_equal(got[:n], li) and np.array_equal(got[n:], ri)
    assert _native.stage_index([3, 1], 4, (2, np.int64(0)), 3, addr, cap, False) == 2
    assert raw[:16].view(np.int32).tolist() == [3, 1, 2, 0]
    assert _native.stage_index(5, 6, 0, 1, addr, cap, True) == 1
    assert raw[:16].view(np.int64).tolist() == [5, 0]
    assert _native.stage_index([], 0, np.zeros(0, np.int64), 0, 0, 0, False) == 0
    assert _native.stage_index(np.array([7]), 8, [7], 8, addr, cap, False) == 1
    bad_hi = li.copy()
    bad_hi[40000] = n
    bad: list[tuple[Any, Any, type[BaseException]]] = [
        ([0, 1], [0], ValueError), ([0], [8], IndexError), ([0.5], [1], TypeError), ([-1], [0], IndexError),
        ([True], [0], TypeError), (np.array([1.0]), [0], TypeError), ([2**70], [0], IndexError),
        (np.array([2**63], np.uint64), [0], IndexError), (np.array([8]), [0], IndexError),
        (np.array([-1], np.int32), [0], IndexError), (np.arange(4)[::2], [0, 1], ValueError),
    ]
    for a, b, exc in bad:
        with pytest.raises(exc):
            _native.stage_index(a, 8, b, 8, addr, cap, False)
    for a, b in ((bad_hi, ri), (li, -ri), (li, ri.astype(np.int32) - 1)):
        with pytest.raises(IndexError):
            _native.stage_index(a, n, b, n, addr, cap, False)
    # lists of different lengths: the bad index is reported against its own list
    with pytest.raises(IndexError, match=f"list of {n}$"):
        _native.stage_index(bad_hi, n, ri, n + 5, addr, cap, False)
    with pytest.raises(IndexError, match=f"list of {n - 1}$"):
        _native.stage_index(li, n + 5, ri, n - 1, addr, cap, True)  # ri holds n - 1
    with pytest.raises(ValueError):
        _native.stage_parallel(3)
    with pytest.raises(ValueError, match="too small"):
        _native.stage_index(li, n, ri, n, addr, 8 * n - 1, False)


def test_native_stage_helpers_survive_fork() -> None:
    """Index staging with the helper threads, then in a forked child (whose helpers are gone and are
    started again), then in the parent again: every result right, nothing hangs."""
    from kvx import _native
    from kvx.testing.procs import forked_ok

    prev = _native.stage_parallel(2)
    try:
        n = 1 << 16
        a = np.random.default_rng(1).permutation(n).astype(np.int64)
        b = np.arange(n, dtype=np.int64)
        out = np.zeros(2 * n, dtype=np.int32)

        def staged_right() -> bool:
            out[:] = 0
            return (_native.stage_index(a, n, b, n, out.ctypes.data, out.nbytes, False) == n
                    and np.array_equal(out[:n], a) and np.array_equal(out[n:], b))

        assert staged_right()
        assert forked_ok(lambda: staged_right() and staged_right(), 30.0)
        assert staged_right()
    finally:
        _native.stage_parallel(prev)


def test_native_cuda_post_calls_in_order() -> None:
    """``_native.cuda_post`` (copy + launch + record in one call): driven with stand-in functions."""
    import ctypes

    from kvx import _native

    calls: list[tuple[Any, ...]] = []
    rcs = {"copy": 0, "launch": 0, "record": 0}
    vp, u = ctypes.c_void_p, ctypes.c_uint

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, vp, ctypes.c_size_t, vp)
    def copy(dst: int, src: int, nb: int, stream: int) -> int:
        calls.append(("copy", dst, src, nb, stream))
        return rcs["copy"]

    @ctypes.CFUNCTYPE(ctypes.c_int, vp, u, u, u, u, u, u, u, vp, vp, vp)
    def launch(f: int, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, sh: int, stream: int, params: int,
               extra: Any) -> int:
        pp = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
        a = [ctypes.c_uint64.from_address(pp[i]).value for i in range(8)]
        calls.append(("launch", f, gx, gy, gz, bx, by, bz, sh, stream, a, ctypes.c_uint32.from_address(pp[8]).value))
        return rcs["launch"]

    @ctypes.CFUNCTYPE(ctypes.c_int, vp, vp)
    def record(ev: int, stream: int) -> int:
        calls.append(("record", ev, stream))
        return rcs["record"]

    fns = [ctypes.cast(f, vp).value for f in (copy, launch, record)]
    a = [1, 2, 3, 4, 5, 2**64 - 1, 7, 8]
    assert _native.cuda_post(*fns, 0x1000, 0x2000, 96, 0x30, 0x40, 132, 256, *a, 14, 0x50) == (3, 0)
    assert calls == [("copy", 0x1000, 0x2000, 96, 0x30), ("launch", 0x40, 132, 1, 1, 256, 1, 1, 0, 0x30, a, 14),
                     ("record", 0x50, 0x30)]
    calls.clear()  # nothing to copy, no launch, no event: nothing called
    assert _native.cuda_post(*fns, 0, 0, 0, 0x30, 0, 1, 32, *a, 14, 0) == (3, 0)
    assert calls == []
    rcs["launch"] = 201  # stops at the first failure and says where
    assert _native.cuda_post(*fns, 0x1000, 0x2000, 96, 0x30, 0x40, 1, 32, *a, 14, 0x50) == (1, 201)
    assert [c[0] for c in calls] == ["copy", "launch"]
    with pytest.raises(ValueError):
        _native.cuda_post(0, fns[1], fns[2], 0x1000, 0x2000, 96, 0x30, 0x40, 1, 32, *a, 14, 0)


def test_native_cuda_route_stages_guards_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_native.CudaRoute.post`` (the cached route's whole launch in one call), with stand-in driver
    functions: indices checked and staged, the target's guards raised and checked, the context made
    current and restored, the kernel launched with its arguments, the event recorded; bad input and
    a released target leave no counter raised and launch nothing."""
    import ctypes

    from kvx import _native

    calls: list[tuple[Any, ...]] = []
    rcs = {"launch": 0, "record": 0}
    cur = [0x5]  # the current context of this thread (a stand-in)
    vp, u = ctypes.c_void_p, ctypes.c_uint

    @ctypes.CFUNCTYPE(ctypes.c_int, vp, u, u, u, u, u, u, u, vp, vp, vp)
    def launch(f: int, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, sh: int, stream: int, params: int,
               extra: Any) -> int:
        pp = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
        a = [ctypes.c_uint64.from_address(pp[i]).value for i in range(8)]
        calls.append(("launch", f, gx, bx, stream, a, ctypes.c_uint32.from_address(pp[8]).value, cur[0]))
        return rcs["launch"]

    @ctypes.CFUNCTYPE(ctypes.c_int, vp, vp)
    def record(ev: int, stream: int) -> int:
        calls.append(("record", ev, stream, cur[0]))
        return rcs["record"]

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p))
    def ctx_get(out: Any) -> int:
        out[0] = cur[0] or None
        return 0

    @ctypes.CFUNCTYPE(ctypes.c_int, vp)
    def ctx_set(ctx: int) -> int:
        calls.append(("ctx", ctx or 0))
        cur[0] = ctx or 0
        return 0

    fns = [ctypes.cast(f, vp).value for f in (launch, record, ctx_get, ctx_set)]
    # the target's control words: two registrations (state, in-flight counter)
    ctl = np.zeros(4, dtype=np.uint64)
    ctl[0], ctl[2] = 3, 5  # states: live generations 3 and 5
    base = ctl.ctypes.data
    guards = np.array([base, 3, base + 8, base + 16, 5, base + 24], dtype=np.uint64)
    n_dst, n_src, ulen = 10, 12, 40000  # 40000 bytes per block: 3 items of 16 KiB
    for wide in (False, True):
        route = _native.CudaRoute(*fns, 0x7, 0x30, 0x40, 256, 528, 14, 0xA0, 0xB0, 0xC0, ulen, n_dst, n_src,
                                  wide, guards)
        slot = np.zeros(64, dtype=np.uint8)
        addr = slot.ctypes.data
        calls.clear()
        n, step, rc = route.post(np.array([9, 0, 4], dtype=np.int64), [11, 2, 3], addr, 64, 0x50)
        assert (n, step, rc) == (3, 3, 0)
        it = np.int64 if wide else np.int32
        assert slot.view(it)[:6].tolist() == [9, 0, 4, 11, 2, 3]
        items = 3 * 3
        grid = (items * 32 + 255) // 256
        assert calls == [("ctx", 0x7), ("launch", 0x40, grid, 256, 0x30, [0xA0, 0xB0, addr, 0xC0, 0, 3, ulen, items],
                                        14, 0x7), ("record", 0x50, 0x30, 0x7), ("ctx", 0x5)]
        assert ctl[1] == 1 and ctl[3] == 1  # both counters raised (the caller lowers them at completion)
        ctl[1] = ctl[3] = 0
        # context already current: no switch; no event: no record
        cur[0] = 0x7
        calls.clear()
        assert route.post(1, 2, addr, 64, 0) == (1, 3, 0)
        assert [c[0] for c in calls] == ["launch"]
        cur[0] = 0x5
        ctl[1] = ctl[3] = 0
        # bad input: raises, nothing raised, nothing launched
        calls.clear()
        for di, si, exc in (([10], [0], IndexError), ([0], [12], IndexError), ([-1], [0], IndexError),
                            ([0, 1], [0], ValueError), (np.array([0.5]), [0], TypeError), (["a"], [0], TypeError),
                            ([], [], ValueError)):
            with pytest.raises(exc):
                route.post(di, si, addr, 64, 0x50)
        with pytest.raises(ValueError):  # slot too small
            route.post(list(range(9)), list(range(9)), addr, 64, 0x50)
        assert calls == [] and ctl[1] == 0 and ctl[3] == 0
        # the target released the second registration: counters lowered again, nothing launched
        ctl[2] = 6
        assert route.post([1], [1], addr, 64, 0x50) == (1, -1, 0)
        assert calls == [] and ctl[1] == 0 and ctl[3] == 0
        ctl[2] = 5
        # a failed launch says where; the counters stay raised for the caller; the context is restored
        rcs["launch"] = 700
        assert route.post([1], [1], addr, 64, 0x50) == (1, 1, 700)
        assert [c[0] for c in calls] == ["ctx", "launch", "ctx"] and cur[0] == 0x5
        assert ctl[1] == 1 and ctl[3] == 1
        ctl[1] = ctl[3] = 0
        rcs["launch"] = 0
    # small transfers: chunks halved while the items still fit the grid's warps (528 x 256 / 32),
    # down to min_shift; as kvx.backends.cuda.indices._chunk_shift
    from kvx.backends.cuda.indices import _chunk_shift

    for min_shift, n_pairs, want_shift in ((12, 3, 12), (13, 3, 13), (12, 200, 12), (12, 500, 13), (12, 2000, 14),
                                         (15, 3, 14)):
        route = _native.CudaRoute(*fns, 0x7, 0x30, 0x40, 256, 528, 14, 0xA0, 0xB0, 0xC0, ulen, 4000, 4000, False,
                                  guards, min_shift)
        slot = np.zeros(16 * n_pairs, dtype=np.uint8)
        calls.clear()
        assert route.post(np.arange(n_pairs), np.arange(n_pairs), slot.ctypes.data, slot.size, 0) == (n_pairs, 3, 0)
        ctl[1] = ctl[3] = 0
        launch_args = calls[1]
        items = n_pairs * -(-ulen // (1 << want_shift))
        assert launch_args[6] == want_shift and launch_args[5][7] == items, (min_shift, n_pairs, launch_args)
        assert launch_args[2] == min(528, (items * 32 + 255) // 256)
        assert _chunk_shift(n_pairs, ulen, 528 * 256 // 32, 14, min_shift) == want_shift
    # strided lists (head slices of 512 bytes, 64 per descriptor) on the group kernel: the strides'
    # arrays where the lengths go, the piece length and count in one argument, groups of pieces as
    # items (as kvx.backends.cuda.indices._group_shift picks them), the bytes moved per pair
    from kvx.backends.cuda.indices import _group_shift

    for n_pairs in (1, 7, 56, 3000):
        route = _native.CudaRoute(*fns, 0x7, 0x30, 0x40, 256, 528, 14, 0xA0, 0xB0, 0xC0, 512, 4000, 4000, False,
                                  guards, 12, 64, 0xD0, 8192)
        slot = np.zeros(16 * n_pairs, dtype=np.uint8)
        calls.clear()
        assert route.post(np.arange(n_pairs), np.arange(n_pairs), slot.ctypes.data, slot.size, 0) == (n_pairs, 3, 0)
        ctl[1] = ctl[3] = 0
        gs = _group_shift(n_pairs, 64, 512, 8192, 528 * 256 // 32)
        items = n_pairs * -(-64 // (1 << gs))
        launch_args = calls[1]
        assert launch_args[5] == [0xA0, 0xB0, slot.ctypes.data, 0xC0, 0xD0, n_pairs, 512 | 64 << 32, items]
        assert launch_args[6] == gs and launch_args[2] == min(528, (items * 32 + 255) // 256), (n_pairs, launch_args)
    for count, dsp, group, ulen_s in ((1, 0xD0, 8192, 512), (64, 0, 8192, 512), (64, 0xD0, 8192, 8192),
                                      (1 << 31, 0xD0, 8192, 512)):
        with pytest.raises(ValueError, match="strided"):
            _native.CudaRoute(*fns, 0x7, 0x30, 0x40, 256, 528, 14, 0xA0, 0xB0, 0xC0, ulen_s, 1, 1, False, guards,
                              12, count, dsp, group)
    with pytest.raises(ValueError):  # guards must be u64 triples
        _native.CudaRoute(*fns, 0x7, 0x30, 0x40, 256, 528, 14, 0xA0, 0xB0, 0xC0, ulen, 1, 1, False, guards[:4])
    with pytest.raises(ValueError):  # no kernel
        _native.CudaRoute(*fns, 0x7, 0x30, 0, 256, 528, 14, 0xA0, 0xB0, 0xC0, ulen, 1, 1, False, guards)


def test_group_shift_of_the_strided_group_kernel() -> None:
    """Pieces per warp of the strided group kernel: groups of up to ``group`` bytes and ``count``
    pieces, halved while they would leave the grid's warps idle; a warp per piece for pieces over
    half a group, a single piece, or group 0 (as kvx.backends.cuda.indices._group_shift)."""
    from kvx.backends.cuda.indices import _group_shift

    warps = 528 * 256 // 32
    assert _group_shift(100000, 64, 512, 8192, warps) == 4  # 16 pieces of 512 B: 8 KiB a warp
    assert _group_shift(100000, 7, 512, 8192, warps) == 3  # no larger than the count (8 >= 7)
    assert _group_shift(100000, 64, 128, 8192, warps) == 6  # the whole count
    assert _group_shift(100, 64, 512, 8192, warps) == 0  # few pairs: a warp per piece keeps the grid busy
    assert _group_shift(1000, 64, 512, 8192, warps) == 3  # 1000 x 4 groups < 4224 warps, 1000 x 8 not
    for count, ulen, group in ((1, 512, 8192), (64, 4097, 8192), (64, 512, 0), (64, 512, 1000)):
        assert _group_shift(100000, count, ulen, group, warps) == -1


def test_options_from_the_environment_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """``CudaOptions``: the three deployment knobs default to their ``KVX_CUDA_*`` variables, read when
    the options are made (not at import); a bad value is a UsageError naming the variable or field;
    the advanced fields are checked too."""
    from kvx.backends.cuda import CudaOptions

    monkeypatch.setenv("KVX_CUDA_SPIN_US", "500")
    monkeypatch.setenv("KVX_CUDA_COPY", "ce")
    monkeypatch.setenv("KVX_CUDA_EXEC", "pull")
    o = CudaOptions()
    assert (o.spin_us, o.copy, o.exec_on) == (500.0, "ce", "pull")
    monkeypatch.setenv("KVX_CUDA_SPIN_US", "abc")
    with pytest.raises(kvx.UsageError, match="KVX_CUDA_SPIN_US='abc'"):
        CudaOptions()
    monkeypatch.delenv("KVX_CUDA_SPIN_US")
    monkeypatch.delenv("KVX_CUDA_COPY")
    monkeypatch.delenv("KVX_CUDA_EXEC")
    assert (CudaOptions().spin_us, CudaOptions().copy, CudaOptions().exec_on) == (2000.0, "auto", "initiator")
    with pytest.raises(kvx.UsageError, match="copy"):  # an option() field: checked by AgentConfig
        kvx.AgentConfig(options={"cuda": CudaOptions(copy="fast")})
    with pytest.raises(kvx.UsageError, match="exec_on"):
        kvx.AgentConfig(options={"cuda": CudaOptions(exec_on="anywhere")})
    for bad in ({"threads": 100}, {"threads": 2048}, {"kernel": "turbo"}, {"staging_slots": 0},
                {"split_fraction": 1.5}, {"route": 1}, {"chunk_shift": 40}, {"auto_plan": ()},
                {"auto_plan": ((8 << 20, "ce", 0.0), (0, "kernel", 0.0))}, {"auto_plan": ((0, "dma", 0.0),)},
                {"blocks_per_sm": 0}, {"reaper_lazy": -1.0}, {"pipe_pairs": -1}):
        with pytest.raises(kvx.UsageError, match=f"CudaOptions.{next(iter(bad))}"):
            CudaOptions(**bad)
    ok = CudaOptions(threads=128, kernel="warp", auto_plan=((0, "kernel", 0.0), (1 << 20, "split", 0.3)))
    assert ok.threads == 128 and ok.auto_plan[1] == (1 << 20, "split", 0.3)


def test_error_map() -> None:
    """The backend's one error map: a CUDA return code, cupy's CUDA exceptions (matched by class
    without importing cupy) and a libcuda that does not load become the kvx class of the boundary
    (TransferError unless ``where`` names another), with the cause kept; kvx errors pass through."""
    from kvx.backends.cuda import ERRORS, CudaError
    from kvx.backends.cuda.errors import fail

    err = fail(700, "CUDA kernel launch")
    assert type(err) is kvx.TransferError and str(err) == "CUDA kernel launch failed with CUDA error 700"
    assert isinstance(err.__cause__, CudaError) and err.__cause__.code == 700
    err = fail(1, (kvx.RegistrationError, "cuMemGetAddressRange(0x10)"))
    assert type(err) is kvx.RegistrationError and "cuMemGetAddressRange(0x10) failed with CUDA error 1" in str(err)

    runtime_error = type("CUDARuntimeError", (RuntimeError,), {"__module__": "cupy_backends.cuda.api.runtime"})
    exc = runtime_error("cudaErrorInvalidValue: invalid argument")
    err = ERRORS(exc, (kvx.BackendUnavailable, "cannot open 'p''s GPU memory with CUDA IPC on GPU 1"))
    assert type(err) is kvx.BackendUnavailable and str(err).endswith("GPU 1: cudaErrorInvalidValue: invalid argument")
    assert type(ERRORS(exc, "CUDA launch failed")) is kvx.TransferError
    lookalike = type("CUDARuntimeError", (RuntimeError,), {"__module__": "somewhere.else"})
    assert type(ERRORS(lookalike("x"), "CUDA launch failed")) is kvx.TransferError  # the default: still kvx
    err = ERRORS(OSError(2, "libcuda.so.1: cannot open shared object file"), (kvx.BackendUnavailable,
                                                                              "libcuda.so.1 not loadable"))
    assert type(err) is kvx.BackendUnavailable and "not loadable" in str(err)
    gone = kvx.PeerDisconnected("p")
    assert ERRORS(gone, "x") is gone
    with pytest.raises(kvx.TransferError) as info:
        with ERRORS.mapped("CUDA launch failed"):
            raise exc
    assert info.value.__cause__ is exc


def test_route_dispatch_without_a_gpu() -> None:
    """``CudaRoute`` (the post contract), driven with a stand-in backend (no GPU here): the pair's
    first post and posts with a notification take the general path with normalised indices; later
    ones the fast poster with the indices as given, falling back to the general path for a form it
    refuses; a bad index is a UsageError at the route; a plan checks its indices when made."""
    import types

    from kvx.backends.base import DoneRequest, Op
    from kvx.backends.cuda.route import CudaRoute

    calls: list[tuple[str, Any, Any, Any]] = []

    class StandIn:
        route_on = False  # the fast poster then calls _post with the indices as given

        def _post(self, op: Op, local: Any, lidx: Any, remote: Any, ridx: Any, notify: bytes | None) -> Any:
            calls.append(("post", lidx, ridx, notify))
            if type(lidx) is np.ndarray and lidx.dtype == np.int16:
                raise TypeError("int16 indices are not taken as they are")
            li = np.atleast_1d(np.asarray(lidx))
            if li.dtype.kind not in "iu":
                raise TypeError(f"indices must be integers, not {li.dtype}")
            if li.size and int(li.max()) >= 8:
                raise IndexError("descriptor index out of range for a list of 8")
            return DoneRequest(4096 * li.size)

    plist = types.SimpleNamespace(bdata={"cuda": types.SimpleNamespace(addr=np.zeros(8, np.uint64))})
    r = CudaRoute(StandIn(), Op.WRITE, plist, plist)  # type: ignore[arg-type]
    i32 = np.array([1, 2], np.int32)
    assert r.post(i32, [3, 4], None).nbytes == 8192
    assert calls[-1][1].dtype == np.int64 and calls[-1][2] == [3, 4]  # first post: general, normalised
    assert r.post(i32, [3, 4], None).nbytes == 8192
    assert calls[-1][1] is i32  # then the fast poster, indices as given
    calls.clear()
    i16 = np.array([5], np.int16)
    assert r.post(i16, [6], None).nbytes == 4096
    assert [c[1].dtype for c in calls] == [np.int16, np.int64]  # refused as given, converted, posted
    calls.clear()
    r.post([0], [1], b"note")
    assert [c[3] for c in calls] == [b"note"]  # a notification: the general path only
    for bad in ([8], [0.5], np.array([9], np.int16)):
        with pytest.raises(kvx.UsageError):
            r.post(bad, [0], None)
    calls.clear()
    with pytest.raises(kvx.UsageError):
        r.plan([0, 8], [0, 1], None)
    with pytest.raises(kvx.UsageError):
        r.plan([0, 1], [0], None)
    assert calls == []  # nothing posted by a plan that was refused
    post = r.plan(np.array([1, 2], np.int32), [3, 4], None)
    assert post().nbytes == 8192 and post().nbytes == 8192
    assert len(calls) == 2 and all(c[1].dtype == np.int64 for c in calls)  # checked once, as int64


def test_native_cuda_event_spin_polls_until_done_or_bound() -> None:
    """``_native.cuda_event_spin`` (a waiter's poll without the GIL): driven with a stand-in cuEventQuery."""
    import ctypes

    from kvx import _native

    seen: list[int] = []
    script: list[int] = []

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
    def query(ev: int) -> int:
        seen.append(ev)
        return script.pop(0) if script else 600

    q = ctypes.cast(query, ctypes.c_void_p).value
    assert q
    script[:] = [600, 600, 600, 0]  # not ready three times, then done
    assert _native.cuda_event_spin(q, 0x77, 10**9) == 0
    assert seen == [0x77] * 4
    script[:] = [700]  # an error ends the spin at once with that code
    seen.clear()
    assert _native.cuda_event_spin(q, 0x77, 10**9) == 700 and len(seen) == 1
    t0 = time.monotonic()  # never ready: back at the bound, still "not ready"
    assert _native.cuda_event_spin(q, 0x77, 20_000_000) == 600
    assert 0.02 <= time.monotonic() - t0 < 2.0
    script[:] = [600, 0]  # max_ns 0: one query (a poll), whatever it says
    seen.clear()
    assert _native.cuda_event_spin(q, 0x77, 0) == 600 and seen == [0x77]
    assert _native.cuda_event_spin(q, 0x77, 0) == 0 and seen == [0x77] * 2
    with pytest.raises(ValueError):
        _native.cuda_event_spin(0, 0x77, 1000)


# ---- GPU --------------------------------------------------------------------------------------

CFG = {"backends": ["cuda"], "peer_timeout": 3.0}
#: legacy CUDA IPC cannot export VMM memory (PyTorch's expandable segments)
TORCH_ENV = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}
PATHS = ["kernel", "ce"]
#: ``split``: part of the bytes on the copy engines, the rest by the kernel, at once
PATHS_SPLIT = [*PATHS, "split"]


def _ndev() -> int:
    import cupy

    return int(cupy.cuda.runtime.getDeviceCount())


def _config(**opts: Any) -> kvx.AgentConfig:
    """The initiator's configuration, with ``CudaOptions(**opts)`` if any (``copy`` ce or split: skips
    where the driver has no cuMemcpyBatchAsync)."""
    from kvx.backends.cuda import CudaOptions
    from kvx.backends.cuda.driver import _driver

    if opts.get("copy") in ("ce", "split") and not _driver().has_batch:
        pytest.skip("cuMemcpyBatchAsync not available (CUDA < 12.8)")
    return kvx.AgentConfig(backends=("cuda",), peer_timeout=3.0,
                           options={"cuda": CudaOptions(**opts)} if opts else {})


@pytest.fixture(scope="module")
def helper() -> Any:
    if _reason() is not None:
        pytest.skip(f"no GPU: {_reason()}")
    h = Helper("target", CFG, env=TORCH_ENV)
    yield h
    h.close()


@pytest.fixture
def agent(helper: Helper) -> Any:
    a = kvx.Agent("initiator", _config())
    yield a
    a.close()


@pytest.fixture
def make_agent(helper: Helper) -> Any:
    """``make_agent(**opts)``: an initiator whose cuda backend has ``CudaOptions(**opts)``; closed after
    the test."""
    made: list[kvx.Agent] = []

    def make(name: str = "initiator", **opts: Any) -> kvx.Agent:
        a = kvx.Agent(name, _config(**opts))
        made.append(a)
        return a

    yield make
    for a in made:
        a.close()


def _local(seg: str, n: int, dev: int = 0) -> tuple[Any, Any]:
    return alloc(seg, n, dev)


def _xp(view: Any) -> Any:
    if isinstance(view, np.ndarray):
        return np
    import cupy

    return cupy


def _host(view: Any) -> np.ndarray:
    return view if isinstance(view, np.ndarray) else view.get()


def _count_general_posts(monkeypatch: pytest.MonkeyPatch, agent: kvx.Agent) -> list[int]:
    """A list that grows by one per post through the backend's general path (not a route's native
    launch): which way a repost went."""
    be: Any = agent.backend("cuda")
    calls: list[int] = []
    real = be._post

    def post(*args: Any) -> Any:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(be, "_post", post)
    return calls


@pytest.mark.gpu
class TestConformanceAcrossGpus(TransferConformance):
    backend = "cuda"
    mem, local_mem = "vram:1", "vram:0"
    env = TORCH_ENV


@pytest.mark.gpu
class TestConformanceOneGpu(TransferConformance):
    backend = "cuda"
    mem, local_mem = "vram:0", "vram:0"
    env = TORCH_ENV


@pytest.mark.gpu
class TestConformanceToPinnedHost(TransferConformance):
    backend = "cuda"
    mem, local_mem = "pinned", "vram:0"
    env = TORCH_ENV


@pytest.mark.gpu
class TestConformanceFromPinnedHost(TransferConformance):
    backend = "cuda"
    mem, local_mem = "vram:1", "pinned"
    env = TORCH_ENV


@pytest.mark.gpu
class TestConformanceIntoTorch(TransferConformance):
    backend = "cuda"
    mem, local_mem = "torch:1", "vram:0"
    env = TORCH_ENV


SEGS = [("vram", "vram", 0), ("vram", "vram", 1), ("vram", "pinned", 0), ("pinned", "vram", 1),
        ("vram", "torch", 1), ("torch", "vram", 0)]


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("lseg,rseg,rdev", SEGS)
@pytest.mark.parametrize("bs", [1, 4096, 4097, 65536])
def test_write_then_read_permuted(make_agent: Any, helper: Helper, path: str, lseg: str, rseg: str, rdev: int,
                                  bs: int) -> None:
    if rdev >= _ndev():
        pytest.skip("needs two GPUs")
    if "torch" in (lseg, rseg):
        pytest.importorskip("torch")
    agent = make_agent(copy=path)
    n = 64
    rid, rdescs = helper.register(rseg, n * bs, rdev)
    try:
        peer = agent.add_peer(helper.meta)
        obj, view = _local(lseg, n * bs)
        xp = _xp(view)
        view[:] = pattern(xp, n * bs, bs)
        reg = agent.register(obj)
        local = agent.prepare(kvx.DescList.blocks(reg, bs))
        remote = agent.prepare(kvx.DescList.blocks(rdescs, bs), peer=peer)
        perm = np.random.default_rng(bs).permutation(n)
        if rseg == "torch" and "cuda" not in remote.bdata:
            # VMM memory (PyTorch expandable segments) is refused, never written at a wrong place
            with pytest.raises(kvx.BackendUnavailable):
                agent.write(local, np.arange(n), remote, perm)
            pytest.xfail("remote PyTorch memory is VMM-mapped here: legacy CUDA IPC cannot export it")
        x = agent.write(local, np.arange(n), remote, perm)
        assert x.wait(30) is x and x.status is kvx.Status.DONE and x.backend == "cuda"
        assert x.nbytes == n * bs
        src = _host(view).copy()
        exp = np.empty(n * bs, np.uint8)
        exp.reshape(n, bs)[perm] = src.reshape(n, bs)
        got = helper.digest(rid)
        if got != digest(np, exp):
            remote_now = np.frombuffer(helper.peek(rid, 0, n * bs), np.uint8)
            pytest.fail(f"remote bytes differ: {int((remote_now != exp).sum())} of {n * bs} wrong, "
                        f"{int((remote_now == 0).sum())} zero; rdescs={rdescs.addr[0]:#x}")
        view[:] = 0
        agent.read(local, perm, remote, np.arange(n)).wait(30)
        back = np.empty_like(src)
        back.reshape(n, bs)[perm] = exp.reshape(n, bs)
        assert np.array_equal(_host(view), back)
        view[:] = 0
        agent.read(local, np.arange(n), remote, perm).wait(30)
        assert np.array_equal(_host(view), src)
        reg.release()
    finally:
        helper.call(cmd="free", id=rid)


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS_SPLIT)
@pytest.mark.parametrize("exec_on", ["initiator", "owner", "pull"])
@pytest.mark.parametrize("bs", [4096, 4097])
def test_exec_gpu_choice_cross_gpu(helper: Helper, path: str, exec_on: str, bs: int) -> None:
    """Every executing-GPU policy moves the right bytes between GPU 0 and another process's GPU 1,
    also when the source was filled on GPU 0's default stream just before the post."""
    if _ndev() < 2:
        pytest.skip("needs two GPUs")
    import cupy

    n = 256
    rid, rdescs = helper.register("vram", n * bs, 1)
    a = kvx.Agent(f"exec-{exec_on}", _config(copy=path, exec_on=exec_on))
    try:
        peer = a.add_peer(helper.meta)
        with cupy.cuda.Device(0):
            view = cupy.zeros(n * bs, cupy.uint8)
        reg = a.register(view)
        local = a.prepare(kvx.DescList.blocks(reg, bs))
        remote = a.prepare(kvx.DescList.blocks(rdescs, bs), peer=peer)
        perm = np.random.default_rng(bs).permutation(n)
        with cupy.cuda.Device(0):
            view[:] = pattern(cupy, n * bs, bs + 1)  # queued on GPU 0's default stream, not synchronized
        a.write(local, np.arange(n), remote, perm).wait(30)
        src = pattern(np, n * bs, bs + 1)
        exp = np.empty(n * bs, np.uint8)
        exp.reshape(n, bs)[perm] = src.reshape(n, bs)
        assert helper.digest(rid) == digest(np, exp)
        with cupy.cuda.Device(0):
            view[:] = 0
        a.read(local, np.arange(n), remote, perm).wait(30)
        assert np.array_equal(view.get(), src)
        reg.release()
    finally:
        a.close()
        helper.call(cmd="free", id=rid)


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS_SPLIT)
def test_odd_sizes_and_alignments(make_agent: Any, helper: Helper, path: str) -> None:
    """Unequal lengths, odd offsets on both sides (every co-alignment class), large and tiny."""
    agent = make_agent(copy=path)
    rng = np.random.default_rng(5)
    lens = np.array([1, 3, 15, 16, 17, 31, 100, 4095, 4097, 65537, 1 << 20, (1 << 20) + 13, 7, 2], dtype=np.uint64)
    loffs = np.array([0, 1, 2, 3, 4, 8, 9, 12, 16, 5, 7, 0, 1, 3], dtype=np.uint64)
    roffs = np.array([0, 3, 2, 7, 4, 0, 1, 4, 16, 5, 6, 8, 1, 1], dtype=np.uint64)
    span = int(lens.sum()) + 64 * len(lens)
    rid, rdescs = helper.register("vram", span, min(1, _ndev() - 1))
    try:
        peer = agent.add_peer(helper.meta)
        obj, view = _local("vram", span)
        reg = agent.register(obj)
        lstart = np.concatenate(([0], np.cumsum(lens + 64)[:-1])).astype(np.uint64)
        laddr = np.uint64(reg.descs.addr[0]) + lstart + loffs
        raddr = np.uint64(rdescs.addr[0]) + lstart + roffs
        ldl = kvx.DescList.from_arrays(kind=kvx.MemoryKind.CUDA, addr=laddr, nbytes=lens, dev=int(reg.descs.dev[0]))
        rdl = kvx.DescList.from_arrays(kind=kvx.MemoryKind.CUDA, addr=raddr, nbytes=lens, dev=int(rdescs.dev[0]))
        local = agent.prepare(ldl)
        remote = agent.prepare(rdl, peer=peer)
        src = rng.integers(0, 256, span, dtype=np.uint8)
        import cupy

        view[:] = cupy.asarray(src)
        idx = rng.permutation(len(lens))
        agent.write(local, idx, remote, idx).wait(30)
        got = np.frombuffer(helper.peek(rid, 0, span), dtype=np.uint8)
        exp = np.zeros(span, np.uint8)
        for i in idx.tolist():
            lo, ro, ln = int(lstart[i] + loffs[i]), int(lstart[i] + roffs[i]), int(lens[i])
            exp[ro: ro + ln] = src[lo: lo + ln]
        assert np.array_equal(got, exp)
        view[:] = 0
        agent.read(local, idx, remote, idx).wait(30)
        back = np.zeros(span, np.uint8)
        for i in idx.tolist():
            lo, ro, ln = int(lstart[i] + loffs[i]), int(lstart[i] + roffs[i]), int(lens[i])
            back[lo: lo + ln] = exp[ro: ro + ln]
        assert np.array_equal(view.get(), back)
        with pytest.raises(kvx.UsageError):  # 1 byte vs 3 bytes
            agent.write(local, [0], remote, [1])
        reg.release()
    finally:
        helper.call(cmd="free", id=rid)


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS_SPLIT)
def test_loopback_same_and_peer_device_and_pinned(path: str) -> None:
    import cupy

    with kvx.Agent("solo", _config(copy=path)) as a:
        bs, n = 8192 + 16, 32
        devs = [0, 1] if _ndev() > 1 else [0, 0]
        with cupy.cuda.Device(devs[0]):
            g0 = cupy.asarray(pattern(np, n * bs, 3))
        with cupy.cuda.Device(devs[1]):
            g1 = cupy.zeros(n * bs, dtype=cupy.uint8)
        g2 = cupy.zeros(n * bs, dtype=cupy.uint8)
        h = kvx.alloc_host(n * bs, pinned=True)
        r0, r1, r2, rh = a.register(g0), a.register(g1), a.register(g2), a.register(h)
        p0, p1, p2, ph = (a.prepare(kvx.DescList.blocks(r, bs)) for r in (r0, r1, r2, rh))
        perm = np.random.default_rng(1).permutation(n)
        a.write(p0, np.arange(n), p1, perm).wait(30)  # GPU0 -> GPU1 (or same GPU)
        a.write(p0, np.arange(n), p2, perm).wait(30)  # same GPU
        a.read(p0, np.arange(n), ph, perm).wait(30)  # pinned -> GPU (zeros back into g0 blocks)
        src = pattern(np, n * bs, 3)
        exp = np.empty_like(src)
        exp.reshape(n, bs)[perm] = src.reshape(n, bs)
        assert np.array_equal(g1.get(), exp)
        assert np.array_equal(g2.get(), exp)
        assert not g0.get().any()
        a.write(p2, perm, ph, perm).wait(30)  # GPU -> pinned
        assert np.array_equal(h, exp)
        x = a.write(p1, [0], p2, [1], notify=b"self")
        x.wait(10)
        assert a.notifications(timeout=5.0) == {"solo": [b"self"]}
        for r in (r0, r1, r2, rh):
            r.release()


@pytest.mark.gpu
@pytest.mark.parametrize("order", ["legacy", "caller"])
def test_stream_order_of_the_copies(order: str) -> None:
    """``CudaOptions.order``: ``legacy`` copies wait for work queued on the legacy default stream
    before them (a kernel spinning ~1 s there holds a later copy), ``caller`` copies do not (the
    caller posted ready bytes): what lets a layer's write overlap the next layers' compute."""
    import cupy

    spin = cupy.RawKernel(r"""extern "C" __global__ void spin(long long n) {
        long long t = clock64(); while (clock64() - t < n) { } }""", "spin")
    with kvx.Agent("solo", _config(copy="kernel", order=order)) as a:
        bs, n = 4096, 64
        src = cupy.asarray(pattern(np, n * bs, 5))
        dst = cupy.zeros(n * bs, dtype=cupy.uint8)
        cupy.cuda.Device().synchronize()  # the source is ready before the spin is queued
        ps, pd = (a.prepare(kvx.DescList.blocks(a.register(x), bs)) for x in (src, dst))
        a.write(ps, np.arange(n), pd, np.arange(n)).wait(30)  # first use: set-up that synchronises
        dst[:] = 0
        cupy.cuda.Device().synchronize()
        rate = int(cupy.cuda.Device().attributes["ClockRate"]) * 1000  # cycles per second
        spin((1,), (1,), (np.int64(rate),))  # ~1 s on the legacy default stream
        t0 = time.monotonic()
        a.write(ps, np.arange(n), pd, np.arange(n)).wait(30)
        took = time.monotonic() - t0
        cupy.cuda.Device().synchronize()
        assert np.array_equal(dst.get(), pattern(np, n * bs, 5))
        if order == "legacy":
            assert took > 0.4, f"the copy did not wait for the spin ({took:.3f} s)"
        else:
            assert took < 0.4, f"the copy waited for later work on the legacy stream ({took:.3f} s)"


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["kernel", "ce"])
def test_a_negative_index_is_refused_on_every_copy_path(path: str) -> None:
    """Indices given as a list reach the backend as given (the kernel path checks them while
    staging them, the copy-engine path checks them first): on every path a negative or too large
    index is refused (it never wraps around to the last block) and nothing moves."""
    import cupy

    with kvx.Agent("solo", _config(copy=path)) as a:
        bs, n = 4096, 8
        src = cupy.asarray(pattern(np, n * bs, 7))
        dst = cupy.zeros(n * bs, dtype=cupy.uint8)
        ps, pd = (a.prepare(kvx.DescList.blocks(a.register(x), bs)) for x in (src, dst))
        for bad in ([-1], [0, n]):
            with pytest.raises(kvx.UsageError, match="out of range"):
                a.write(ps, bad, pd, list(range(len(bad)))).wait(10)
        cupy.cuda.Device().synchronize()
        assert not dst.get().any()
        a.write(ps, [n - 1], pd, [0]).wait(10)  # a good list still moves
        assert np.array_equal(dst.get()[:bs], pattern(np, n * bs, 7)[(n - 1) * bs:])


@pytest.mark.gpu
def test_raw_region_and_unpinned_host(agent: kvx.Agent) -> None:
    import cupy

    g = cupy.arange(1 << 16, dtype=cupy.uint8)
    reg = agent.register(kvx.RawRegion(int(g.data.ptr), int(g.nbytes), kvx.MemoryKind.CUDA, 0))
    loc = agent.prepare(kvx.DescList.blocks(reg, 4096))
    host = agent.register(np.zeros(1 << 16, np.uint8))  # not pinned: the cuda backend refuses it
    hp = agent.prepare(kvx.DescList.blocks(host, 4096))
    with pytest.raises(kvx.BackendUnavailable):
        agent.write(loc, [0], hp, [0])
    with pytest.raises(kvx.RegistrationError):  # not device memory of GPU 0
        agent.register(kvx.RawRegion(0x1000, 4096, kvx.MemoryKind.CUDA, 0))


@contextlib.contextmanager
def _gpu_pair(agent: kvx.Agent, helper: Helper, bs: int, n: int, seed: int) -> Iterator[tuple[int, Any, Any, Any]]:
    """The target's GPU memory (on GPU 1 when there are two) and this process's, ``n`` blocks of ``bs``
    bytes each, the local one filled with ``pattern(seed)``: (target id, registration, local list,
    remote list). The caller releases the registration; the target's memory is freed on leaving."""
    rid, rdescs = helper.register("vram", n * bs, min(1, _ndev() - 1))
    try:
        peer = agent.add_peer(helper.meta)
        obj, view = _local("vram", n * bs)
        view[:] = pattern(_xp(view), n * bs, seed)
        reg = agent.register(obj)
        yield (rid, reg, agent.prepare(kvx.DescList.blocks(reg, bs)),
               agent.prepare(kvx.DescList.blocks(rdescs, bs), peer=peer))
    finally:
        helper.call(cmd="free", id=rid)


def _scattered(perm: Any, bs: int, seed: int) -> str:
    """Digest of the target once block ``i`` of ``pattern(seed)`` landed at block ``perm[i]``, for every
    block (``perm`` a permutation of them all)."""
    n = len(perm)
    exp = np.zeros((n, bs), np.uint8)
    exp[perm] = pattern(np, n * bs, seed).reshape(n, bs)
    return digest(np, exp.reshape(-1))


@pytest.mark.gpu
@pytest.mark.parametrize("route", [True, False])
def test_index_forms_and_bad_indices(make_agent: Any, helper: Helper, monkeypatch: pytest.MonkeyPatch,
                                     route: bool) -> None:
    """Every index form through the agent's cached route of the pair (a native ``_Route``, or
    ``post()`` with ``CudaOptions(route=False)``), and bad indices rejected with nothing moved."""
    agent = make_agent(route=route)
    rid, rdescs = helper.register("vram", 8 * 64, 0)
    try:
        peer = agent.add_peer(helper.meta)
        obj, view = _local("vram", 8 * 64)
        view[:] = pattern(_xp(view), 8 * 64, 2)
        reg = agent.register(obj)
        local = agent.prepare(kvx.DescList.blocks(reg, 64))
        remote = agent.prepare(kvx.DescList.blocks(rdescs, 64), peer=peer)
        for li, ri in [([0, 1], [1, 0]), ((2,), (3,)), (np.array([4], np.int32), np.array([5], np.uint64)), (6, 7),
                       (np.int64(7), np.int64(6))]:
            agent.write(local, li, remote, ri).wait(10)
        for li, ri in [(np.array([0, 9, 1])[::2], np.array([1, 9, 0])[::2]),  # strided, and 16-bit: converted
                       (np.array([2], np.int16), np.array([3], np.int16))]:  # (the same pairs again, repeated)
            agent.write(local, li, remote, ri).wait(10)
        b = pattern(np, 8 * 64, 2).reshape(8, 64)
        exp = np.zeros((8, 64), np.uint8)
        exp[1], exp[0], exp[3], exp[5], exp[7], exp[6] = b[0], b[1], b[2], b[4], b[6], b[7]
        assert helper.digest(rid) == digest(np, exp.reshape(-1))
        assert any(r.backend.name == "cuda" for r in local.wroutes.values())  # the pair's route was kept
        general = _count_general_posts(monkeypatch, agent)  # which way a repost goes
        agent.write(local, [0], remote, [1]).wait(10)
        assert len(general) == (0 if route else 1)
        for li, ri in [([0, 1], [0]), ([0], [8]), ([0.5], [1]), ([-1], [0]),
                       (np.arange(2), np.array([0, 8])), (np.array([0, -1]), np.arange(2)),  # native staging
                       (np.arange(8, dtype=np.int32), np.array([0, 1, 2, 3, 4, 5, 6, 9], np.int32))]:
            with pytest.raises(kvx.UsageError):
                agent.write(local, li, remote, ri)
        assert helper.digest(rid) == digest(np, exp.reshape(-1))
        reg.release()
    finally:
        helper.call(cmd="free", id=rid)


@pytest.mark.gpu
def test_route_from_several_threads(make_agent: Any, helper: Helper) -> None:
    """Four threads post through one pair's route at once, many transfers each before waiting, on a
    staging ring of two slots: every transfer ends and every byte lands where its indices say."""
    import threading

    agent = make_agent(staging_slots=2)
    bs, n, k = 4096, 512, 4
    with _gpu_pair(agent, helper, bs, n, 13) as (rid, reg, local, remote):
        perm = np.random.default_rng(5).permutation(n)
        agent.write(local, [0], remote, [int(perm[0])]).wait(10)  # the pair's route from here on
        errors: list[BaseException] = []

        def run(t: int) -> None:
            try:
                mine = np.arange(t, n, k)
                xs = [agent.write(local, mine[j::3], remote, perm[mine[j::3]]) for _ in range(4) for j in range(3)]
                for x in xs:
                    x.wait(30)
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(t,)) for t in range(k)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert not any(th.is_alive() for th in threads) and not errors, errors
        assert helper.digest(rid) == _scattered(perm, bs, 13)
        reg.release()


@pytest.mark.gpu
def test_route_reuses_slot_events(make_agent: Any, helper: Helper, monkeypatch: pytest.MonkeyPatch) -> None:
    """The route records each staging slot's own event: a slot taken again retires the transfer that
    last used it (its event is recorded anew), so an unwaited transfer never reads as pending again;
    every transfer ends, in any order of waiting, and every byte lands."""
    agent = make_agent(staging_slots=2)
    bs, n, k = 4096, 256, 8
    with _gpu_pair(agent, helper, bs, n, 17) as (rid, reg, local, remote):
        perm = np.random.default_rng(7).permutation(n)
        agent.write(local, [0], remote, [int(perm[0])]).wait(10)  # the pair's route from here on
        be = agent.backend("cuda")
        reqs: list[Any] = []
        real_add = be._reaper.add
        monkeypatch.setattr(be._reaper, "add", lambda r: (reqs.append(r), real_add(r)))
        parts = np.array_split(np.arange(n), k)
        xs = [agent.write(local, p, remote, perm[p]) for p in parts]  # nobody waits yet
        assert len(reqs) == k
        events = [r.event for r in reqs]
        assert len({id(e) for e in events}) <= 2  # the slots' own events, recorded again and again
        for i, r in enumerate(reqs):  # a transfer whose slot (event) was taken again was retired then
            if any(e is events[i] for e in events[i + 1:]):
                assert r._done, i
        for x in reversed(xs):
            x.wait(30)
            assert x.status is kvx.Status.DONE
        assert helper.digest(rid) == _scattered(perm, bs, 17)
        reg.release()


@pytest.mark.gpu
@pytest.mark.parametrize("route", [True, False])
def test_plan_reposts_through_the_route(make_agent: Any, helper: Helper, monkeypatch: pytest.MonkeyPatch,
                                        route: bool) -> None:
    """``make_transfer`` on cuda: indices checked when the plan is made; each post goes through the
    pair's native route (``CudaOptions(route=False)``: through the general path), every time."""
    agent = make_agent(route=route)
    bs, n = 4096, 64
    with _gpu_pair(agent, helper, bs, n, 9) as (rid, reg, local, remote):
        with pytest.raises(kvx.UsageError):
            agent.make_transfer("write", local, [0, 1], remote, [0, n])
        perm = np.random.default_rng(3).permutation(n)
        plan = agent.make_transfer("write", local, np.arange(n), remote, perm)
        want = _scattered(perm, bs, 9)
        general = _count_general_posts(monkeypatch, agent)
        for k in range(1, 4):
            helper.call(cmd="zero", id=rid)
            plan.post().wait(10)
            assert len(general) == (0 if route else k)
            assert helper.digest(rid) == want
        reg.release()


@pytest.mark.gpu
@pytest.mark.parametrize("spin", [0.0, 1e-6, 0.002])
def test_wait_spins_then_polls(make_agent: Any, helper: Helper, spin: float) -> None:
    """``Transfer.wait``: a native spin on the event bounded by ``CudaOptions.spin_us`` (none, one that
    ends long before the copy, the default), then the Python loop; each ends with every byte in place."""
    agent = make_agent(spin_us=spin * 1e6)
    assert agent.backend("cuda").spin_wait == pytest.approx(spin)  # type: ignore[attr-defined]
    size, bs = 16 << 20, 4096
    rid, rdescs = helper.register("vram", size, 0)
    try:
        peer = agent.add_peer(helper.meta)
        obj, view = _local("vram", size)
        view[:] = pattern(_xp(view), size, 5)
        reg = agent.register(obj)
        n = size // bs
        ri = np.random.default_rng(1).permutation(n)
        local = agent.prepare(kvx.DescList.blocks(reg, bs))
        remote = agent.prepare(kvx.DescList.blocks(rdescs, bs), peer=peer)
        for _ in range(2):
            x = agent.write(local, np.arange(n), remote, ri)
            assert x.wait(10).done()
        assert helper.digest(rid) == _scattered(ri, bs, 5)
        reg.release()
    finally:
        helper.call(cmd="free", id=rid)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["int32", "int64", "upload", "upload-int64"])
def test_staging_ring_back_to_back(make_agent: Any, helper: Helper, variant: str) -> None:
    """Index staging: posts without waiting wrap a ring of 2 slots (the oldest is waited for), slots
    grow on demand; int32 indices (default), int64 (forced), read in place from the pinned slot by the
    kernel (zero copy, the default) or uploaded before it."""
    agent = make_agent(copy="kernel", staging_slots=2, index_i32=not variant.endswith("int64"),
                       index_zerocopy=not variant.startswith("upload"))
    bs, n = 64, 1 << 14
    rid, rdescs = helper.register("vram", n * bs, min(1, _ndev() - 1))
    try:
        peer = agent.add_peer(helper.meta)
        obj, view = _local("vram", n * bs)
        view[:] = pattern(_xp(view), n * bs, 21)
        reg = agent.register(obj)
        local = agent.prepare(kvx.DescList.blocks(reg, bs))
        remote = agent.prepare(kvx.DescList.blocks(rdescs, bs), peer=peer)
        perm = np.random.default_rng(21).permutation(n)
        reqs, lo = [], 0
        for k in (1, 5000, 2, 9000, 300, 2000):  # 9000 pairs need more than a first slot's 64 KiB
            ids = np.arange(lo, lo + k, dtype=np.int64)
            reqs.append(agent.write(local, ids, remote, perm[ids]))
            lo += k
        for r in reqs:
            r.wait(30)
        b = pattern(np, n * bs, 21).reshape(n, bs)
        exp = np.zeros((n, bs), np.uint8)
        exp[perm[:lo]] = b[:lo]
        assert helper.digest(rid) == digest(np, exp.reshape(-1))
        reg.release()
    finally:
        helper.call(cmd="free", id=rid)


@pytest.mark.gpu
@pytest.mark.parametrize("min_shift", [12, 14])
@pytest.mark.parametrize("kernel", ["warpx", "warp"])
@pytest.mark.parametrize("op", ["write", "read"])
def test_kernel_item_orders(make_agent: Any, helper: Helper, kernel: str, op: str, min_shift: int) -> None:
    """Blocks of several work items (3 full 16 KiB chunks + a 100-byte tail; with ``chunk_shift_min``
    12 this small transfer is cut into 4 KiB items instead), permuted, both ways, posted twice (the
    general path, then the pair's route): chunk-major (``warpx``, the default) and block-major
    (``warp``) items land every byte."""
    agent = make_agent(copy="kernel", kernel=kernel, chunk_shift_min=min_shift)
    bs, n = 3 * 16384 + 100, 48
    rid, rdescs = helper.register("vram", n * bs, min(1, _ndev() - 1))
    try:
        peer = agent.add_peer(helper.meta)
        obj, view = _local("vram", n * bs)
        reg = agent.register(obj)
        local = agent.prepare(kvx.DescList.blocks(reg, bs))
        remote = agent.prepare(kvx.DescList.blocks(rdescs, bs), peer=peer)
        perm = np.random.default_rng(9).permutation(n).astype(np.int64)
        ids = np.arange(n, dtype=np.int64)
        b = pattern(np, n * bs, 9).reshape(n, bs)
        exp = np.zeros((n, bs), np.uint8)
        for _ in range(2):
            if op == "write":
                helper.call(cmd="zero", id=rid)
                view[:] = pattern(_xp(view), n * bs, 9)
                agent.write(local, ids, remote, perm).wait(20)
                exp[perm] = b
                assert helper.digest(rid) == digest(np, exp.reshape(-1))
            else:
                helper.call(cmd="fill", id=rid, seed=9)
                view[:] = 0
                agent.read(local, ids, remote, perm).wait(20)
                exp[:] = b[perm]
                assert digest(_xp(view), view) == digest(np, exp.reshape(-1))
        reg.release()
    finally:
        helper.call(cmd="free", id=rid)


@pytest.mark.gpu
def test_bad_copy_setting() -> None:
    if _reason() is not None:
        pytest.skip(_reason() or "")
    old = os.environ.get("KVX_CUDA_COPY")
    os.environ["KVX_CUDA_COPY"] = "bogus"
    try:
        with pytest.raises(kvx.UsageError):
            kvx.Agent("bad", _config())
    finally:
        if old is None:
            del os.environ["KVX_CUDA_COPY"]
        else:
            os.environ["KVX_CUDA_COPY"] = old


# ---- strided lists (head slices): the strided kernel -----------------------------------------------

STRIDED_SEGS = [("vram", "vram", 0), ("vram", "vram", 1), ("vram", "pinned", 0), ("pinned", "vram", 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("lseg,rseg,rdev", STRIDED_SEGS)
@pytest.mark.parametrize("piece", [1024, 13, 70000])  # an NHD head slice, odd, several chunks per piece
def test_strided_lists_through_the_strided_kernel(make_agent: Any, helper: Helper, lseg: str, rseg: str, rdev: int,
                                                  piece: int) -> None:
    """Strided lists of one count move through the strided kernel (one index pair per descriptor
    pair; no FlatRoute), byte-exact both ways, with other strides on each side, between processes."""
    from kvx.backends.base import FlatRoute

    if rdev >= _ndev():
        pytest.skip("needs two GPUs")
    agent = make_agent()
    n, count = 24, 7
    lrow, rrow = piece * 3 + 16, piece * 2 + 8  # stride of the pieces on each side
    lblk, rblk = count * lrow, count * rrow
    rid, rdescs = helper.register(rseg, n * rblk, rdev)
    try:
        peer = agent.add_peer(helper.meta)
        obj, view = _local(lseg, n * lblk)
        xp = _xp(view)
        view[:] = pattern(xp, n * lblk, 3)
        reg = agent.register(obj)
        la = int(reg.descs.addr[0]) + np.arange(n, dtype=np.uint64) * np.uint64(lblk) + np.uint64(piece)
        ra = int(rdescs.addr[0]) + np.arange(n, dtype=np.uint64) * np.uint64(rblk) + np.uint64(8)
        ld = kvx.DescList.strided(kind=reg.descs.kind, addr=la, nbytes=piece, count=count, stride=lrow,
                                  dev=int(reg.descs.dev[0]))
        rd = kvx.DescList.strided(kind=rdescs.kind, addr=ra, nbytes=piece, count=count, stride=rrow,
                                  dev=int(rdescs.dev[0]))
        local = agent.prepare(ld)
        remote = agent.prepare(kvx.DescList.from_bytes(rd.to_bytes()), peer=peer)
        assert local.bdata["cuda"].count == count and remote.bdata["cuda"].count == count
        perm = np.random.default_rng(piece).permutation(n)
        x = agent.write(local, np.arange(n), remote, perm)
        assert x.wait(30).status is kvx.Status.DONE and x.nbytes == n * count * piece
        assert not isinstance(local.wroutes[remote], FlatRoute)
        src = _host(view).copy()
        there = np.frombuffer(helper.peek(rid, 0, n * rblk), np.uint8)
        want = np.zeros(n * rblk, np.uint8)
        for i, j in enumerate(perm):
            for k in range(count):
                s0, d0 = i * lblk + piece + k * lrow, j * rblk + 8 + k * rrow
                want[d0:d0 + piece] = src[s0:s0 + piece]
        assert np.array_equal(there, want)
        view[:] = 0
        agent.read(local, perm, remote, np.arange(n)).wait(30)
        back = _host(view)
        for i, j in enumerate(perm):
            for k in range(count):
                s0, d0 = i * rblk + 8 + k * rrow, j * lblk + piece + k * lrow
                assert np.array_equal(back[d0:d0 + piece], there[s0:s0 + piece])
        # a count that differs is refused before anything moves
        other = agent.prepare(kvx.DescList.strided(kind=reg.descs.kind, addr=la[:1], nbytes=piece, count=count - 1,
                                                   stride=lrow, dev=int(reg.descs.dev[0])))
        with pytest.raises(kvx.UsageError):
            agent.write(other, [0], remote, [0])
        reg.release()
    finally:
        helper.call(cmd="free", id=rid)


@pytest.mark.gpu
@pytest.mark.parametrize("piece,count", [(16, 2), (512, 7), (512, 64), (2048, 3), (4096, 5), (496, 9)])
@pytest.mark.parametrize("skew", [0, 8])  # 16-byte co-aligned groups, and groups the warp copies piece by piece
def test_strided_small_pieces_in_groups(agent: kvx.Agent, piece: int, count: int, skew: int) -> None:
    """Head slices of a few hundred bytes go through the group kernel (a warp per group of pieces,
    the count not a multiple of the group), byte-exact, and no byte outside the slices is written."""
    from kvx.backends.base import FlatRoute

    if _reason() is not None:
        pytest.skip(_reason() or "")
    import cupy

    n, srow, drow = 40, 2 * piece + 32, 3 * piece + 48 + skew
    sblk, dblk = count * srow, count * drow
    src = cupy.random.default_rng(piece).integers(0, 256, n * sblk, dtype=cupy.uint8)
    dst = cupy.zeros(n * dblk + 64, dtype=cupy.uint8)
    agent.register(src)
    agent.register(dst)
    sa = src.data.ptr + np.arange(n, dtype=np.uint64) * np.uint64(sblk) + np.uint64(piece)
    da = dst.data.ptr + np.arange(n, dtype=np.uint64) * np.uint64(dblk) + np.uint64(16 + skew)
    s = agent.prepare(kvx.DescList.strided(kind=kvx.MemoryKind.CUDA, addr=sa, nbytes=piece, count=count, stride=srow,
                                           dev=0))
    d = agent.prepare(kvx.DescList.strided(kind=kvx.MemoryKind.CUDA, addr=da, nbytes=piece, count=count, stride=drow,
                                           dev=0))
    perm = np.random.default_rng(count).permutation(n)
    x = agent.read(d, perm, s, np.arange(n))
    assert x.wait(30).status is kvx.Status.DONE and x.nbytes == n * count * piece
    assert not isinstance(d.rroutes[s], FlatRoute)
    h, g = src.get(), dst.get()
    want = np.zeros_like(g)
    for i, j in enumerate(perm):
        for k in range(count):
            s0, d0 = i * sblk + piece + k * srow, j * dblk + 16 + skew + k * drow
            want[d0:d0 + piece] = h[s0:s0 + piece]
    assert np.array_equal(g, want)


@pytest.mark.gpu
def test_strided_lists_of_mixed_counts_move_as_pieces(agent: kvx.Agent) -> None:
    """Counts that differ inside a list: the cuda backend moves the expansion (FlatRoute), byte-exact."""
    from kvx.backends.base import FlatRoute

    if _reason() is not None:
        pytest.skip(_reason() or "")
    import cupy

    src = cupy.arange(1 << 16, dtype=cupy.uint32).view(cupy.uint8)
    dst = cupy.zeros(1 << 18, dtype=cupy.uint8)
    agent.register(src)
    agent.register(dst)
    s = agent.prepare(kvx.DescList.strided(kind=kvx.MemoryKind.CUDA, addr=[src.data.ptr, src.data.ptr + 4096],
                                           nbytes=100, count=[3, 5], stride=1000, dev=0))
    d = agent.prepare(kvx.DescList.strided(kind=kvx.MemoryKind.CUDA, addr=[dst.data.ptr, dst.data.ptr + 65536],
                                           nbytes=100, count=[3, 5], stride=[300, 7000], dev=0))
    agent.read(d, [0, 1], s, [0, 1]).wait(30)
    assert isinstance(d.rroutes[s], FlatRoute)
    h, g = src.get(), dst.get()
    for k in range(3):
        assert np.array_equal(g[k * 300:k * 300 + 100], h[k * 1000:k * 1000 + 100])
    for k in range(5):
        assert np.array_equal(g[65536 + k * 7000:65536 + k * 7000 + 100], h[4096 + k * 1000:4096 + k * 1000 + 100])
