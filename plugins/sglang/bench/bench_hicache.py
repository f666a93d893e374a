"""HiCache L3 storage backends side by side: kvx vs SGLang's HiCacheNixl (POSIX) and HiCacheFile.

Each backend stores and loads the same pages of one real SGLang host pool (MHA, page_first,
the default layout), through the very functions SGLang's ``HiCacheController`` uses for it:
the zero-copy ``_page_set_zero_copy``/``_page_get_zero_copy`` for kvx (``dynamic`` with
``interface_v1``) and NIXL, the copying ``_generic_page_set``/``_generic_page_get`` for the
file backend. Batches of 128 pages (SGLang's ``STORAGE_BATCH_SIZE``), fresh keys every
round, backends interleaved round by round; every loaded page is compared byte for byte
outside the timed region. All stores write buffered files under one directory (one
filesystem); reads therefore come from the page cache for every backend alike. Before each timed
set the dirty pages of every earlier set are written back (``os.sync``, outside the timing), so
no store's set is throttled by the writeback of the gigabytes the other stores wrote: without it
(``--no-sync``), once the dirty pages pass the kernel's limits every buffered store's set runs at
the disk's writeback rate alike, whichever wrote them. Each page size's stores live in a
directory of their own, removed after that page size. The time to
build each backend is reported (also per GiB of store). ``kvx`` is the store as built by
default (no prefault: a first write into a never-written slot goes through ``pwritev``);
``kvx-noprefault`` the same with ``prefault_gb: 0`` spelled out (the same configuration since
the default is 0: two columns of one configuration in one run show the run's noise);
``kvx-window`` prefaults a window of PREFAULT_BATCHES batches ahead of the fill in a background
thread, whose work is let finish outside every timed region, reported per batch and also
charged to its sets; ``kvx-inline`` moves every batch in the calling thread (``inline: true``)
instead of on kvx's I/O threads. Besides wall-clock pages/s, the process CPU time of each set and get is
reported (its ratios: the other store's CPU time over kvx's), which other load on a shared
machine disturbs far less.

    python bench/bench_hicache.py [--dir DIR] [--rounds N] [--page-sizes 16,64] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import torch
from pools import fill, mha_pool, page_bytes, storage_config, token_indices
from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

#: Qwen2.5-0.5B's KV geometry (24 layers, 2 KV heads of 64, bf16): 12 KiB per token.
GEOMETRY = {"layers": 24, "heads": 2, "head_dim": 64}
#: kvx's prefault window in batches (the slab holds rounds + 1 batches).
PREFAULT_BATCHES = 4


def _slab(backend: Any) -> Any:
    pages = getattr(backend, "pages", None)
    return pages if hasattr(pages, "prefault_idle") else None


def _prefault_s(backend: Any) -> float:
    slab = _slab(backend)
    return float(slab.prefault_seconds) if slab is not None else 0.0


class RawFiles:
    """The ceiling of a buffered first fill: no store, no index, no checksum; each batch into a
    fresh file with one ``pwritev`` per page of its fragments (the calling thread), read back
    with one ``preadv`` per page."""

    def __init__(self, d: str) -> None:
        self.d = d
        self.files: dict[str, str] = {}

    def register_mem_pool_host(self, pool: Any) -> None:
        self.pool = pool

    def _iov(self, idx: Any) -> list[list[Any]]:
        import ctypes

        ps = self.pool.page_size
        out = []
        for i in range(0, len(idx), ps):
            ptrs, sizes = self.pool.get_page_buffer_meta(idx[i:i + ps])
            out.append([(ctypes.c_char * int(n)).from_address(int(a)) for a, n in zip(ptrs, sizes)])
        return out

    @staticmethod
    def page_set(ctl: Any, keys: list[str], idx: Any) -> bool:
        self: RawFiles = ctl.storage_backend
        path = os.path.join(self.d, f"b{len(self.files)}")
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
        try:
            off = 0
            for iov in self._iov(idx):
                off += os.pwritev(fd, iov, off)
        finally:
            os.close(fd)
        self.files[keys[0]] = path
        return True

    @staticmethod
    def page_get(ctl: Any, op: Any, keys: list[str], idx: Any) -> int:
        self: RawFiles = ctl.storage_backend
        fd = os.open(self.files[keys[0]], os.O_RDONLY)
        try:
            off = 0
            for iov in self._iov(idx):
                off += os.preadv(fd, iov, off)
        finally:
            os.close(fd)
        return len(keys)


def _settle(backend: Any) -> None:
    """Let a kvx slab's background prefault catch up (outside every timed region)."""
    slab = _slab(backend)
    if slab is not None and not slab.prefault_idle(60.0):
        raise RuntimeError("the slab's prefault did not catch up within 60 s")


def build(name: str, root: str, pool: Any, capacity_gb: float) -> tuple[Any, Any, Any]:
    """The backend and the controller's (page_set, page_get) functions for it."""
    d = os.path.join(root, f"{name}-{pool.page_size}")
    os.makedirs(d, exist_ok=True)
    if name in ("kvx", "kvx-window", "kvx-full", "kvx-direct", "kvx-noprefault", "kvx-inline"):
        if name == "kvx-full":  # a slab of exactly one batch: every set evicts and overwrites slots
            capacity_gb = (STORAGE_BATCH_SIZE + 0.5) * pool.page_size * pool.size_per_token / (1 << 30)
        extra = {"backend_name": "kvx", "module_path": "kvx_sglang.hicache", "class_name": "HiCacheKVX",
                 "interface_v1": 1, "path": d, "capacity_gb": capacity_gb, "direct_io": name == "kvx-direct"}
        # kvx: the defaults; kvx-window: a prefault window of a few batches, less than the slab,
        # so the background top-up is measured too
        window = PREFAULT_BATCHES * STORAGE_BATCH_SIZE * pool.page_size * pool.size_per_token / (1 << 30)
        if name in ("kvx-noprefault", "kvx-window"):
            extra["prefault_gb"] = window if name == "kvx-window" else 0
        if name == "kvx-inline":  # every batch in the calling thread (the default spreads it over the I/O threads)
            extra["inline"] = True
        b = StorageBackendFactory.create_backend("dynamic", storage_config(extra), pool)
        fns = (HiCacheController._page_set_zero_copy, HiCacheController._page_get_zero_copy)
    elif name in ("nixl", "nixl-direct"):
        os.environ["SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR"] = d
        os.environ["SGLANG_HICACHE_NIXL_BACKEND_PLUGIN"] = "POSIX"
        # nixl-direct: O_DIRECT, SGLang's default for HiCacheNixl; nixl: buffered, like the others
        extra = {"use_direct_io": name == "nixl-direct", "l3_cleaner_enabled": False}
        b = StorageBackendFactory.create_backend("nixl", storage_config(extra), pool)
        fns = (HiCacheController._page_set_zero_copy, HiCacheController._page_get_zero_copy)
    elif name == "raw":
        b = RawFiles(d)
        fns = (RawFiles.page_set, RawFiles.page_get)
    else:
        extra = {"file_storage_path": d}
        b = StorageBackendFactory.create_backend("file", storage_config(extra), pool)
        fns = (HiCacheController._generic_page_set, HiCacheController._generic_page_get)
    b.register_mem_pool_host(pool)
    ctl = SimpleNamespace(storage_backend=b, storage_host_pool=pool, mem_pool_host=pool,
                          page_size=pool.page_size)
    return b, ctl, fns


def run(page_size: int, rounds: int, root: str, names: list[str], sync: bool = True) -> dict[str, Any]:
    root = os.path.join(root, f"page{page_size}")  # removed at the end: no dirty pages left behind
    os.makedirs(root)
    try:
        return _run(page_size, rounds, root, names, sync)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run(page_size: int, rounds: int, root: str, names: list[str], sync: bool) -> dict[str, Any]:
    n = STORAGE_BATCH_SIZE
    pool = mha_pool("page_first", page_size=page_size, pages=2 * n + 1, **GEOMETRY)
    fill(pool, page_size)
    pb = page_size * pool.size_per_token
    src = list(range(n))
    dst = list(range(n, 2 * n))
    src_idx, dst_idx = token_indices(src, page_size), token_indices(dst, page_size)
    want = [page_bytes(pool, p) for p in src]
    op = SimpleNamespace(request_id="bench", is_terminated=lambda: False)
    cap = (rounds + 1) * n * pb / (1 << 30)  # every round's pages stay stored, as in the other stores
    # the first build of a library in a process pays its one-time setup (imports, native libraries,
    # thread pools): one throwaway build of each library comes before the timed builds
    for nm in dict.fromkeys(nm.split("-")[0] for nm in names):
        w = build(nm, os.path.join(root, "warmup"), pool, n * pb / (1 << 30))[0]
        _settle(w)
        if hasattr(w, "close"):
            w.close()
    backends = {}
    created: dict[str, float] = {}
    for nm in names:  # the time to build each backend (files, registration, index) is reported too
        t0 = time.perf_counter()
        backends[nm] = build(nm, root, pool, cap)
        created[nm] = time.perf_counter() - t0
        _settle(backends[nm][0])  # a background prefault started by the build ends before the next build
    pf0 = {nm: _prefault_s(b[0]) for nm, b in backends.items()}  # populated at creation
    times: dict[str, dict[str, list[float]]] = {nm: {"set": [], "get": []} for nm in names}
    cpu: dict[str, dict[str, list[float]]] = {nm: {"set": [], "get": []} for nm in names}
    for r in range(rounds + 1):  # round 0 warms up (first files, first transfers) and is not counted
        order = names[r % len(names):] + names[: r % len(names)]
        for nm in order:
            _b, ctl, (pset, pget) = backends[nm]
            keys = [f"{page_size:04x}{r:08x}{i:052x}" for i in range(n)]
            _settle(_b)
            if sync:  # the pages earlier sets dirtied (every store's) written back, outside the timing
                os.sync()
            c0, t0 = time.process_time(), time.perf_counter()
            ok = pset(ctl, keys, src_idx)
            t1, c1 = time.perf_counter(), time.process_time()
            _settle(_b)  # kvx's background prefault runs here, not during another backend's timing
            assert ok, f"{nm}: batch set failed"
            pool.kv_buffer[:, n * page_size:].zero_()
            c2, t2 = time.process_time(), time.perf_counter()
            got = pget(ctl, op, keys, dst_idx)
            t3, c3 = time.perf_counter(), time.process_time()
            assert got == n, f"{nm}: loaded {got} of {n} pages"
            assert [page_bytes(pool, p) for p in dst] == want, f"{nm}: loaded pages differ"
            if r:
                times[nm]["set"].append(t1 - t0)
                times[nm]["get"].append(t3 - t2)
                cpu[nm]["set"].append(c1 - c0)
                cpu[nm]["get"].append(c3 - c2)
    prefault = {nm: (pf0[nm], _prefault_s(b[0]) - pf0[nm]) for nm, b in backends.items()}
    for b, _c, _f in backends.values():
        if hasattr(b, "close"):
            b.close()
    out: dict[str, Any] = {"page_size": page_size, "page_bytes": pb, "batch": n, "capacity_gib": cap,
                           "backends": {}}
    for nm in names:
        row: dict[str, Any] = {"create_s": created[nm], "prefault_create_s": prefault[nm][0],
                               "prefault_background_s_per_batch": prefault[nm][1] / (rounds + 1)}
        for opn in ("set", "get"):
            for stat, f in (("median", statistics.median), ("best", min)):
                t = f(times[nm][opn])
                row[f"{opn}_{stat}"] = {"s_per_batch": t, "pages_per_s": n / t, "GB_per_s": n * pb / t / 1e9}
            row[f"{opn}_cpu_median_s"] = statistics.median(cpu[nm][opn])
            row[f"{opn}_rounds_s"] = times[nm][opn]
            row[f"{opn}_cpu_rounds_s"] = cpu[nm][opn]
        out["backends"][nm] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help="directory for all stores (default: a temp dir)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--page-sizes", default="16,64")
    ap.add_argument("--backends",
                    default="kvx,kvx-window,kvx-noprefault,kvx-inline,kvx-full,nixl,file,raw,kvx-direct,nixl-direct",
                    help="kvx: every page stays stored, so each set writes slab slots for the first time (the "
                         "store as built by default); kvx-window: the same with a "
                         "prefault window of a few batches kept ahead by a background thread; "
                         "kvx-full: the slab holds one batch, so each set evicts and rewrites slots "
                         "(the steady state of a full store); kvx-direct and nixl-direct: O_DIRECT (SGLang's "
                         "default for HiCacheNixl); kvx-noprefault: prefault_gb 0 spelled out (the default); "
                         "kvx-inline: inline true (every batch in the calling thread); raw: the ceiling "
                         "of a buffered first fill (no store: each batch into a fresh file, one pwritev "
                         "per page)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-sync", dest="sync", action="store_false",
                    help="do not write back dirty pages before each timed set: sets then run in whatever "
                         "writeback state the earlier sets (of every store) left, throttled alike once the "
                         "dirty pages pass the kernel's limits")
    a = ap.parse_args()
    torch.set_num_threads(1)
    root = tempfile.mkdtemp(prefix="kvx-hicache-bench-", dir=a.dir)
    names = a.backends.split(",")
    results = []
    try:
        for ps in [int(x) for x in a.page_sizes.split(",")]:
            results.append(run(ps, a.rounds, root, names, a.sync))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    # like against like: buffered kvx against the buffered stores, O_DIRECT against O_DIRECT
    pairs = [(k, r) for k in names if k.startswith("kvx") for r in names
             if not r.startswith("kvx") and k.endswith("-direct") == r.endswith("-direct")]
    print(f"# {platform.node()} {os.cpu_count()} cpus, stores under {os.path.dirname(root)}, "
          f"batch {STORAGE_BATCH_SIZE} pages, {a.rounds} rounds")
    print(f"{'page':>5} {'page KiB':>8} {'op':>4} " + " ".join(f"{nm + ' pages/s':>17} {'GB/s':>6}" for nm in names)
          + "".join(f" {k + '/' + r:>14}" for k, r in pairs))
    for stat in ("median", "best"):
        print(f"## {stat} of {a.rounds} rounds")
        for res in results:
            rows = res["backends"]
            for op in ("set", "get"):
                opn = f"{op}_{stat}"
                line = f"{res['page_size']:>5} {res['page_bytes'] / 1024:>8.0f} {op:>4} "
                line += " ".join(f"{rows[nm][opn]['pages_per_s']:>17.0f} {rows[nm][opn]['GB_per_s']:>6.2f}"
                                 for nm in names)
                line += "".join(f" {rows[k][opn]['pages_per_s'] / rows[r][opn]['pages_per_s']:>13.2f}x"
                                for k, r in pairs)
                print(line)
    print(f"## process CPU time per batch, median of {a.rounds} rounds (all threads of this process, "
          "kernel time in its calls included; less sensitive to other load than the wall times above)")
    for res in results:
        rows = res["backends"]
        for op in ("set", "get"):
            line = f"{res['page_size']:>5} {res['page_bytes'] / 1024:>8.0f} {op:>4} "
            line += " ".join(f"{1e3 * rows[nm][f'{op}_cpu_median_s']:>20.1f} ms" for nm in names)
            line += "".join(f" {rows[r][f'{op}_cpu_median_s'] / rows[k][f'{op}_cpu_median_s']:>13.2f}x"
                            for k, r in pairs)
            print(line)
    for res in results:
        print(f"## time to build each backend (page {res['page_size']}, store of {res['capacity_gib']:.2f} GiB; "
              "kvx: of which prefault), and per GiB of store: "
              + ", ".join(f"{nm} {1e3 * row['create_s']:.0f} ms"
                          + (f" ({1e3 * row['prefault_create_s']:.0f})" if row["prefault_create_s"] else "")
                          + f" = {row['create_s'] / res['capacity_gib']:.3f} s/GiB"
                          for nm, row in res["backends"].items()))
        bg = {nm: row["prefault_background_s_per_batch"] for nm, row in res["backends"].items()
              if row["prefault_background_s_per_batch"] or row["prefault_create_s"]}
        if bg:
            print(f"## background prefault per batch, outside the timed sets (page {res['page_size']}): "
                  + ", ".join(f"{nm} {1e3 * v:.1f} ms" for nm, v in bg.items()))
        rows = res["backends"]
        for nm, v in bg.items():
            if not v or nm.endswith("-direct"):
                continue
            t = rows[nm]["set_median"]["s_per_batch"] + v
            pps = res["batch"] / t
            print(f"## {nm} set with its background prefault charged (page {res['page_size']}): {pps:.0f} pages/s"
                  + "".join(f", {pps / rows[r]['set_median']['pages_per_s']:.2f}x {r}"
                            for r in ("nixl", "file") if r in rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
