"""What a prefill rank moves into a decode rank: the PD transfer plan (no SGLang import).

SGLang hands a transfer backend its KV pool as buffers -- per layer K and V for MHA, one per
layer for MLA -- each an array of pages (``item_len`` bytes per page). An MHA page is
``[page_size tokens][heads on this rank][head bytes]`` (SGLang's NHD layout); each attention-TP
rank holds ``total_kv_heads / attn_tp_size`` heads (or one head, replicated over
``attn_tp_size / total_kv_heads`` ranks, where TP exceeds the heads). MLA keeps the whole latent
on every rank.

:func:`plan_pair` decides, for one (prefill rank, decode rank) pair:

- ``PAGES``: the two ranks hold the same bytes per page (same TP size, or MLA): one descriptor
  per page of every buffer, whole pages;
- ``SLICE``: different TP sizes, MHA: the heads both ranks hold, a run of bytes inside each
  token's row on both sides (one strided descriptor per page of every buffer: ``page_size`` runs,
  a row apart);
- ``SKIP``: another prefill rank of the same decode rank holds the same (replicated) heads and
  sends them; this one sends nothing but completes the room.

:func:`slice_descs` builds a rank's strided list of one head run once (numpy, a descriptor per
page of every buffer); :func:`page_rows` turns a request's page numbers into rows of a per-page
list (whole pages or head runs alike), vectorised. :func:`token_descs` / :func:`token_rows` are the
per-token form (a descriptor per token) for callers that need plain lists. Used by
:mod:`kvx_sglang.pd` and by the GPU benchmark (which cannot import SGLang).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvx import DescList, MemoryKind, UsageError

__all__ = ["Mode", "Pair", "PlanError", "heads_held", "page_rows", "plan_pair", "slice_descs", "token_descs",
           "token_rows"]


class PlanError(UsageError):
    """The two ranks' KV pools cannot be paired (the message says why)."""


class Mode(enum.Enum):
    PAGES = "pages"
    SLICE = "slice"
    SKIP = "skip"


@dataclass(frozen=True, slots=True)
class Pair:
    """How one prefill rank fills one decode rank.

    ``src_off``/``dst_off``/``nbytes``: per KV buffer, the byte run inside a token's row on each
    side (``SLICE``); ``src_row``/``dst_row``: bytes per token row on each side.
    """

    mode: Mode
    src_off: tuple[int, ...] = ()
    dst_off: tuple[int, ...] = ()
    nbytes: tuple[int, ...] = ()
    src_row: tuple[int, ...] = ()
    dst_row: tuple[int, ...] = ()


def heads_held(tp: int, rank: int, total: int) -> tuple[int, int]:
    """``(first, count)`` of the KV heads attention-TP rank ``rank`` of ``tp`` holds."""
    if tp <= 0 or total <= 0 or not 0 <= rank < tp:
        raise PlanError(f"bad attention TP rank {rank} of {tp} for {total} KV heads")
    if total % tp and tp % total:
        raise PlanError(f"{total} KV heads do not shard over attention TP {tp}")
    per = max(1, total // tp)
    rep = max(1, tp // total)
    return (rank // rep) * per, per


def plan_pair(*, mla: bool, src_tp: int, src_rank: int, dst_tp: int, dst_rank: int, total_heads: int,
              page_size: int, src_items: Sequence[int], dst_items: Sequence[int]) -> Pair:
    """The plan for prefill rank ``src_rank`` of ``src_tp`` -> decode rank ``dst_rank`` of ``dst_tp``.

    ``src_items``/``dst_items``: bytes per page of each KV buffer on each side (same order).

    Raises
    ------
    PlanError
        If the pools do not pair: other buffer counts, page sizes that do not split into the
        heads each side holds, or (same TP, or MLA) other bytes per page.
    """
    if len(src_items) != len(dst_items):
        raise PlanError(f"decode has {len(dst_items)} KV buffers, this prefill {len(src_items)}: "
                        "a different model or pipeline layout")
    if mla or src_tp == dst_tp:
        if list(src_items) != list(dst_items):
            raise PlanError("decode's KV pages are of other sizes than this prefill's "
                            f"({sorted(set(dst_items))} vs {sorted(set(src_items))} bytes): different model, "
                            "KV dtype or page size")
        return Pair(Mode.PAGES)
    if page_size <= 0:
        raise PlanError(f"bad page size {page_size}")
    s0, sn = heads_held(src_tp, src_rank, total_heads)
    d0, dn = heads_held(dst_tp, dst_rank, total_heads)
    lo, hi = max(s0, d0), min(s0 + sn, d0 + dn)
    if hi <= lo:
        raise PlanError(f"prefill rank {src_rank}/{src_tp} (heads {s0}..{s0 + sn - 1}) and decode rank "
                        f"{dst_rank}/{dst_tp} (heads {d0}..{d0 + dn - 1}) share no KV head")
    if src_tp > dst_tp:
        # decode rank d gathers from prefill ranks [d*r, (d+1)*r); replicas of one head group among
        # them: only the first sends
        r = src_tp // dst_tp
        rep = max(1, src_tp // total_heads)
        if max((src_rank // rep) * rep, dst_rank * r) < src_rank:
            return Pair(Mode.SKIP)
    so, do, nb, sr, dr = [], [], [], [], []
    for si, di in zip(src_items, dst_items):
        head = si // (page_size * sn)
        if head <= 0 or head * page_size * sn != si or head * page_size * dn != di:
            raise PlanError(f"KV pages of {si} (prefill) and {di} (decode) bytes do not split into {sn} and {dn} "
                            f"heads of {page_size} tokens: another head size or KV layout")
        so.append((lo - s0) * head)
        do.append((lo - d0) * head)
        nb.append((hi - lo) * head)
        sr.append(sn * head)
        dr.append(dn * head)
    if so == [0] * len(so) and do == so and nb == sr and nb == dr:
        return Pair(Mode.PAGES)  # whole rows on both sides (e.g. one head, replicated on both)
    return Pair(Mode.SLICE, tuple(so), tuple(do), tuple(nb), tuple(sr), tuple(dr))


def token_descs(ptrs: Sequence[int], lens: Sequence[int], items: Sequence[int], page_size: int,
                offs: Sequence[int], nbytes: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(addr, nbytes, base)``: a descriptor per token of every buffer (buffer-major), the run of
    ``nbytes[b]`` bytes at ``offs[b]`` inside the token's row; ``base[b]``: buffer ``b``'s first row."""
    counts, addrs, sizes = [], [], []
    for p, n, item, off, nb in zip(ptrs, lens, items, offs, nbytes):
        row = item // page_size
        tokens = (n // item) * page_size
        counts.append(tokens)
        addrs.append(int(p) + off + np.arange(tokens, dtype=np.int64) * row)
        sizes.append(np.full(tokens, nb, dtype=np.int64))
    base = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
    return np.concatenate(addrs), np.concatenate(sizes), base


def slice_descs(ptrs: Sequence[int], lens: Sequence[int], items: Sequence[int], page_size: int,
                offs: Sequence[int], nbytes: Sequence[int], *, kind: MemoryKind, dev: int = 0
                ) -> tuple[DescList, np.ndarray]:
    """``(descs, base)``: a strided descriptor per page of every buffer (buffer-major): the run of
    ``nbytes[b]`` bytes at ``offs[b]`` inside each of the page's ``page_size`` token rows;
    ``base[b]``: buffer ``b``'s first row. A request's rows are :func:`page_rows` of it."""
    counts, addrs, sizes, strides = [], [], [], []
    for p, n, item, off, nb in zip(ptrs, lens, items, offs, nbytes):
        pages = n // item
        counts.append(pages)
        addrs.append(int(p) + off + np.arange(pages, dtype=np.int64) * item)
        sizes.append(np.full(pages, nb, dtype=np.int64))
        strides.append(np.full(pages, item // page_size, dtype=np.int64))
    base = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
    descs = DescList.strided(kind=kind, addr=np.concatenate(addrs).astype(np.uint64),
                             nbytes=np.concatenate(sizes).astype(np.uint64), count=page_size,
                             stride=np.concatenate(strides).astype(np.uint64), dev=dev)
    return descs, base


def page_rows(base: np.ndarray, pages: np.ndarray) -> np.ndarray:
    """Rows of ``pages`` in every buffer of a per-page list (buffer-major)."""
    return (base[:, None] + pages[None, :]).ravel()


def token_rows(base: np.ndarray, pages: np.ndarray, page_size: int) -> np.ndarray:
    """Rows of every token of ``pages`` in every buffer of a per-token list (buffer-major)."""
    tok = (pages[:, None] * page_size + np.arange(page_size, dtype=np.int64)[None, :]).ravel()
    return (base[:, None] + tok[None, :]).ravel()
