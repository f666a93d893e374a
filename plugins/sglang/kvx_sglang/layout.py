"""Where each KV page of an SGLang host pool lies in memory: the page geometry kvx moves.

SGLang's host pools (``HostKVCache`` subclasses) describe a page through
``get_page_buffer_meta(token_indices) -> (ptrs, sizes)``: one or more contiguous fragments per
page (K and V halves in the page-first layouts, one per layer and half in ``layer_first``, one
in MLA page-first). :class:`PageGeometry` asks the pool once, on three pages, and checks that
every fragment moves by a fixed stride from page to page; the descriptors of all pages then
come out of numpy in one step, and a batch of pages is a pair of index arrays.

A stored page is its fragments back to back (``page_bytes``), whatever the host layout, so a
page written from one layout reads back into a pool of another layout only if both cut it into
the same fragments; keys are scoped by model and rank, as in SGLang's own backends.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvx import UsageError

log = logging.getLogger(__name__)

#: Layouts whose page fragments follow a fixed per-page stride (checked at registration anyway).
SUPPORTED_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head", "page_first_kv_split")


class LayoutError(UsageError):
    """The host pool's layout cannot be moved zero-copy by kvx (the message says why)."""


@dataclass(frozen=True, slots=True)
class PageGeometry:
    """Fragments of every page of a host pool.

    ``base[f] + p * stride[f]`` is the address of fragment ``f`` of page ``p`` (``p`` is the
    token index divided by ``page_size``); ``sizes[f]`` its length; ``offsets[f]`` its offset
    inside a stored page of ``page_bytes``.
    """

    layout: str
    page_size: int
    num_pages: int
    base: np.ndarray
    stride: np.ndarray
    sizes: np.ndarray
    offsets: np.ndarray
    page_bytes: int

    @property
    def nfrag(self) -> int:
        return int(self.base.shape[0])

    @classmethod
    def of(cls, pool: Any) -> "PageGeometry":
        """Read the geometry of ``pool`` (an SGLang ``HostKVCache``)."""
        layout = str(getattr(pool, "layout", "?"))
        if layout not in SUPPORTED_LAYOUTS:
            raise LayoutError(
                f"kvx HiCache storage does not support the host pool layout {layout!r} "
                f"(supported: {', '.join(SUPPORTED_LAYOUTS)}); choose one with --hicache-mem-layout")
        meta = getattr(pool, "get_page_buffer_meta", None)
        if meta is None:
            raise LayoutError(f"{type(pool).__name__} has no get_page_buffer_meta: no zero-copy page access")
        page_size = int(pool.page_size)
        size = int(pool.size)
        num_pages = size // page_size
        if num_pages < 2:
            raise LayoutError(f"the host pool holds {num_pages} page(s); kvx needs at least 2")
        import torch  # SGLang's dependency; the pool speaks torch

        def frags(p: int) -> tuple[np.ndarray, np.ndarray]:
            idx = torch.arange(p * page_size, (p + 1) * page_size, dtype=torch.int64)
            try:
                ptrs, sizes = meta(idx)
            except (ValueError, NotImplementedError, AssertionError) as exc:
                raise LayoutError(f"host pool layout {layout!r}: {exc}") from exc
            return np.asarray(ptrs, dtype=np.int64), np.asarray(sizes, dtype=np.int64)

        b0, s0 = frags(0)
        b1, s1 = frags(1)
        if b0.size == 0 or b0.shape != s0.shape or b1.shape != b0.shape or not np.array_equal(s0, s1):
            raise LayoutError(f"host pool layout {layout!r}: pages do not have one fragment structure")
        if int(s0.min()) <= 0:
            raise LayoutError(f"host pool layout {layout!r}: empty page fragment")
        stride = b1 - b0
        for p in (num_pages // 2, num_pages - 1):
            bp, sp = frags(p)
            if bp.shape != b0.shape or not np.array_equal(sp, s0) or not np.array_equal(bp, b0 + p * stride):
                raise LayoutError(f"host pool layout {layout!r}: page fragments do not move by a fixed stride")
        offsets = np.concatenate(([0], np.cumsum(s0)[:-1])).astype(np.int64)
        return cls(layout, page_size, num_pages, b0, stride, s0, offsets, int(s0.sum()))

    # ------------------------------------------------------------------------------------
    def host_addrs(self) -> np.ndarray:
        """Addresses of all fragments, page-major: row ``p * nfrag + f``."""
        p = np.arange(self.num_pages, dtype=np.int64)[:, None]
        return (self.base[None, :] + p * self.stride[None, :]).ravel()

    def host_sizes(self) -> np.ndarray:
        return np.tile(self.sizes, self.num_pages)

    def extent(self) -> tuple[int, int]:
        """Lowest and highest+1 address any fragment of any page touches."""
        a = self.host_addrs()
        return int(a.min()), int((a + self.host_sizes()).max())

    def ranges(self) -> list[tuple[int, int]]:
        """Disjoint ``(addr, nbytes)`` ranges that cover every fragment (to register them)."""
        a = self.host_addrs()
        e = a + self.host_sizes()
        order = np.argsort(a, kind="stable")
        a, e = a[order], e[order]
        out: list[tuple[int, int]] = []
        # merge touching/overlapping fragments, vectorised: a new range starts where a
        # fragment begins past the running maximum end of all before it
        run_end = np.maximum.accumulate(e)
        breaks = np.nonzero(a[1:] > run_end[:-1])[0] + 1
        starts = np.concatenate(([0], breaks))
        ends = np.concatenate((breaks, [a.shape[0]])) - 1
        for s, t in zip(starts, ends):
            start, end = int(a[s]), int(run_end[t])
            out.append((start, end - start))
        return out

    def pages_of(self, host_indices: Any) -> np.ndarray:
        """Page numbers of a batch given as SGLang token indices (``page_size`` per page)."""
        idx = np.asarray(host_indices.cpu().numpy() if hasattr(host_indices, "cpu") else host_indices,
                         dtype=np.int64).ravel()
        if idx.size % self.page_size:
            raise UsageError(f"{idx.size} host indices are not whole pages of {self.page_size}")
        first = idx[:: self.page_size]
        if first.size and (int(first.min()) < 0 or int(first.max()) >= self.num_pages * self.page_size
                           or np.any(first % self.page_size)):
            raise UsageError("host indices outside the host pool or not page-aligned")
        return first // self.page_size

    def frag_index(self, rows: np.ndarray) -> np.ndarray:
        """Descriptor rows of whole pages/slots ``rows`` (``row * nfrag + f``)."""
        return (rows.astype(np.int64)[:, None] * self.nfrag + np.arange(self.nfrag, dtype=np.int64)[None, :]).ravel()
