"""Transfer planning between a prefill and a decode instance of any TP sizes, layouts and block sizes.

Pure numpy and kvx (no vLLM import), so that the same code serves the connector's workers and the
GPU benchmark that drives it without vLLM installed.

The model
---------
Every layer's cache holds, per block, *cells* ``(plane, token, head)`` of ``cell`` bytes each:
``plane`` is K or V (two planes; one for an MLA latent), ``token`` a position in the block,
``head`` one of this rank's KV heads (an MLA latent counts as one head held by every rank). Where
a cell sits is given by strides in bytes, which is all a layout is: vLLM's CPU and GPU ``HND``
(``[num_blocks, num_kv_heads, block_size, 2*head_size]``: a head's tokens contiguous), ``NHD``
(``[2, num_blocks, block_size, num_kv_heads, head_size]`` or the packed ``[num_blocks, block_size,
num_kv_heads, 2*head_size]``: a token's heads contiguous) and MLA's ``[num_blocks, block_size,
head_size]`` are all just strides (:func:`layer_geometry`).

A decode rank reads, from each prefill rank that holds some of its heads, those heads
(:func:`read_plan`: heads replicated over several prefill ranks are read once, spread over the
holders). For one (local rank, remote rank) pair and one layer, :func:`template` lists the cells
of one *super block* (``max`` of the two block sizes, in tokens) in local memory order and merges
runs contiguous on both sides into pieces: a whole page where both layouts agree, a head slice of
a block for HND, a token row piece for NHD; runs of equal pieces at a constant stride on both
sides (NHD's token rows) become one strided piece (``count`` pieces, one stride per side), so an
NHD head slice costs a descriptor per block and plane, not per token. :class:`PeerTables` turns
the templates into the two descriptor lists of that pair, once per peer (``num_blocks * pieces``
descriptors per layer and side; strided :class:`kvx.DescList` where a template has strided
pieces); a request then needs only index arithmetic (:meth:`PeerTables.indices`): one kvx transfer
per (local rank, remote rank) pair, no Python loop over blocks or tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

import kvx

__all__ = ["LayerGeom", "PeerTables", "heads_of", "read_plan", "template", "layer_geometry", "pair_blocks",
           "plan_mismatch"]

_U64 = np.uint64
#: bound on the cells of one layer's super block (a peer's claim beyond it is refused)
MAX_CELLS = 1 << 22
#: bounds on a layer's blocks and on one side's descriptor list (claims beyond are refused)
MAX_BLOCKS = 1 << 24
MAX_DESCS = 1 << 28
_MAX = 1 << 62


@dataclass(frozen=True, slots=True)
class LayerGeom:
    """Where one layer's cells are: cell ``(p, t, h)`` of block ``b`` is ``cell`` bytes at
    ``base + b*block_stride + p*plane_stride + t*token_stride + h*head_stride``."""

    name: str
    group: int
    base: int
    num_blocks: int
    block_stride: int
    block_size: int
    heads: int
    planes: int
    cell: int
    plane_stride: int
    token_stride: int
    head_stride: int

    def to_list(self) -> list[Any]:
        return [self.name, self.group, self.base, self.num_blocks, self.block_stride, self.block_size, self.heads,
                self.planes, self.cell, self.plane_stride, self.token_stride, self.head_stride]

    @classmethod
    def from_list(cls, v: Any) -> "LayerGeom":
        """Parse what a peer sent; anything malformed or out of bounds raises ProtocolError."""
        if not isinstance(v, (list, tuple)) or len(v) != 12 or not isinstance(v[0], str) or len(v[0]) > 512:
            raise kvx.ProtocolError(f"malformed layer geometry {v!r:.200}")
        nums = v[1:]
        if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < _MAX for x in nums):
            raise kvx.ProtocolError(f"malformed layer geometry {v!r:.200}")
        g = cls(v[0], *nums)
        if (g.planes not in (1, 2) or not 0 < g.block_size <= 1 << 16 or not 0 < g.heads <= 1 << 12
                or g.cell <= 0 or not 0 < g.num_blocks <= MAX_BLOCKS
                or g.planes * g.block_size * g.heads > MAX_CELLS):
            raise kvx.ProtocolError(f"layer geometry out of bounds: {v!r:.200}")
        return g

    def offsets(self, tokens: np.ndarray, h0: int, nh: int) -> np.ndarray:
        """Byte offsets (from a block's start) of cells ``(plane, token, head)`` for every plane,
        the given in-block ``tokens`` and heads ``h0 .. h0+nh-1``, as ``[planes, len(tokens), nh]``."""
        p = np.arange(self.planes, dtype=np.int64)[:, None, None] * self.plane_stride
        t = tokens.astype(np.int64)[None, :, None] * self.token_stride
        h = (h0 + np.arange(nh, dtype=np.int64))[None, None, :] * self.head_stride
        return p + t + h


def layer_geometry(name: str, t: Any, group: int, block_size: int, heads: int, head_size: int,
                   mla: bool) -> LayerGeom:
    """Read a layer's cache tensor (torch) into a :class:`LayerGeom`.

    Accepted: ``[B, H, N, 2*D]`` or ``[B, N, H, 2*D]`` (K and V packed in the last dimension; any
    strides, so vLLM's stride orders HND and NHD alike), ``[2, B, N, H, D]`` / ``[2, B, H, N, D]``
    (K and V planes), and MLA's ``[B, N, D]``. ``block_size``, ``heads`` (this rank's KV heads)
    and ``head_size`` come from the layer's KV cache spec and tell the dimensions apart.
    """
    shape = tuple(int(s) for s in t.shape)
    st = tuple(int(s) * int(t.element_size()) for s in t.stride())
    es = int(t.element_size())
    base = int(t.data_ptr())

    def bad() -> NotImplementedError:
        return NotImplementedError(f"layer {name}: KV cache of shape {shape} (strides {st} bytes) is not a layout "
                                   f"kvx_vllm knows (block size {block_size}, {heads} KV heads of {head_size})")

    if mla or len(shape) == 3:
        if len(shape) != 3 or shape[1] != block_size or st[2] != es:
            raise bad()
        return LayerGeom(name, group, base, shape[0], st[0], block_size, 1, 1, shape[2] * es, 0, st[1], 0)
    if len(shape) == 4:
        b, x, y, c = shape
        if c != 2 * head_size or st[3] != es:
            raise bad()
        if (x, y) == (heads, block_size):
            hs, ts = st[1], st[2]
        elif (x, y) == (block_size, heads):
            ts, hs = st[1], st[2]
        else:
            raise bad()
        return LayerGeom(name, group, base, b, st[0], block_size, heads, 2, head_size * es, head_size * es, ts, hs)
    if len(shape) == 5 and shape[0] == 2:
        _, b, x, y, d = shape
        if d != head_size or st[4] != es:
            raise bad()
        if (x, y) == (block_size, heads):
            ts, hs = st[2], st[3]
        elif (x, y) == (heads, block_size):
            hs, ts = st[2], st[3]
        else:
            raise bad()
        return LayerGeom(name, group, base, b, st[1], block_size, heads, 2, head_size * es, st[0], ts, hs)
    raise bad()


# ----------------------------------------------------------------------------------------------
# heads

def heads_of(total: int, tp: int, rank: int) -> tuple[int, int]:
    """``(first global KV head, count)`` rank ``rank`` of ``tp`` holds (vLLM's split: ``total/tp``
    heads each, or one head replicated over ``tp/total`` ranks when ``tp > total``)."""
    if tp <= total:
        n = total // tp
        return rank * n, n
    return rank // (tp // total), 1


def _holders(total: int, tp: int, head: int) -> range:
    if tp <= total:
        r = head // (total // tp)
        return range(r, r + 1)
    k = tp // total
    return range(head * k, head * k + k)


def plan_mismatch(total: int, tp_local: int, tp_remote: int) -> str | None:
    """Why ``total`` KV heads cannot be split over these TP sizes (None: they can)."""
    for side, tp in (("decode", tp_local), ("prefill", tp_remote)):
        if tp <= 0:
            return f"{side} tp_size {tp} is not positive"
        if (tp <= total and total % tp) or (tp > total and tp % total):
            return f"{total} KV heads do not divide over {side} tp_size {tp} (nor it over them)"
    return None


def read_plan(total: int, tp_local: int, rank: int, tp_remote: int
              ) -> tuple[list[tuple[int, int, int, int]], dict[int, int]]:
    """What local rank ``rank`` reads and whom it notifies.

    Returns ``reads``: ``(remote rank, first local head, first remote head, number of heads)``
    (heads relative to each rank's own cache), and ``notify``: remote rank -> how many local ranks
    notify it (the remote rank frees a request's blocks once that many have), for every remote
    rank this rank must notify (those it reads, and unread ones assigned to it).
    """
    def reads_of(d: int) -> list[tuple[int, int, int, int]]:
        h0, n = heads_of(total, tp_local, d)
        out: list[tuple[int, int, int, int]] = []
        for h in range(h0, h0 + n):
            hold = _holders(total, tp_remote, h)
            p = hold[d % len(hold)]
            rh0 = heads_of(total, tp_remote, p)[0]
            if out and out[-1][0] == p and out[-1][1] + out[-1][3] == h - h0 and out[-1][2] + out[-1][3] == h - rh0:
                r, lh, rh, k = out[-1]
                out[-1] = (r, lh, rh, k + 1)
            else:
                out.append((p, h - h0, h - rh0, 1))
        return out

    readers: dict[int, set[int]] = {p: set() for p in range(tp_remote)}
    mine: list[tuple[int, int, int, int]] = []
    for d in range(tp_local):
        rd = reads_of(d)
        if d == rank:
            mine = rd
        for p, *_ in rd:
            readers[p].add(d)
    notify: dict[int, int] = {}
    for p, ds in readers.items():
        if not ds:
            ds = {p % tp_local}
        if rank in ds:
            notify[p] = len(ds)
    return mine, notify


# ----------------------------------------------------------------------------------------------
# pieces

#: largest stride a strided piece takes (kvx.memory.MAX_STRIDE); runs further apart stay pieces
_MAX_STRIDE = 1 << 48
#: shortest run made a strided piece (shorter ones, e.g. the two planes of a same-TP NHD block,
#: stay plain pieces: as cheap, and every backend moves them natively)
MIN_RUN = 4


@dataclass(frozen=True, slots=True)
class Template:
    """The pieces of one super block: sub-block and byte offset on each side, and length; a piece
    is ``count`` runs of ``nbytes`` at ``lstride``/``rstride`` bytes apart on each side."""

    lsub: np.ndarray
    loff: np.ndarray
    rsub: np.ndarray
    roff: np.ndarray
    nbytes: np.ndarray
    count: np.ndarray
    lstride: np.ndarray
    rstride: np.ndarray

    def __len__(self) -> int:
        return int(self.nbytes.size)

    @property
    def strided(self) -> bool:
        return bool(self.count.size) and int(self.count.max()) > 1


def _strided(lsub: np.ndarray, loff: np.ndarray, rsub: np.ndarray, roff: np.ndarray, lens: np.ndarray
             ) -> Template:
    """Group runs of pieces (in local order) of one length and sub-blocks, at one stride on each
    side, into strided pieces (greedy from the first piece of each run)."""
    n = lens.size
    one = np.ones(n, np.int64)
    zero = np.zeros(n, np.int64)
    if n < 2:
        return Template(lsub, loff, rsub, roff, lens, one, zero, zero)
    dl, dr = np.diff(loff), np.diff(roff)
    # link k joins pieces k and k+1 when both could be pieces of one strided piece
    link = ((lsub[1:] == lsub[:-1]) & (rsub[1:] == rsub[:-1]) & (lens[1:] == lens[:-1])
            & (dl >= lens[:-1]) & (dr >= lens[:-1]) & (dl <= _MAX_STRIDE) & (dr <= _MAX_STRIDE))
    if not link.any():
        return Template(lsub, loff, rsub, roff, lens, one, zero, zero)
    same = link[1:] & link[:-1] & (dl[1:] == dl[:-1]) & (dr[1:] == dr[:-1])
    # the last link of each run of equal links
    run_end = np.empty(n - 1, np.int64)
    brk = np.flatnonzero(np.concatenate((~same, [True])))  # link k ends its run where not same[k]
    run_end[:] = brk[np.searchsorted(brk, np.arange(n - 1))]
    starts: list[int] = []
    s = 0
    if not (link[:-1] & link[1:] & ~same).any():
        # no two runs touch: a run of links is one strided piece, every other piece its own
        cut = np.concatenate(([True], ~link))
        starts_a = np.flatnonzero(cut)
    else:  # runs of other strides touch: greedy, one step per strided piece
        while s < n:
            starts.append(s)
            s = int(run_end[s]) + 2 if s < n - 1 and link[s] else s + 1
        starts_a = np.array(starts, np.int64)
    count = np.diff(np.concatenate((starts_a, [n])))
    small = count < MIN_RUN
    if small.any():  # short runs: back to one piece each
        keep = np.zeros(n, bool)
        keep[starts_a[~small]] = True
        pos = np.repeat(small, count)
        keep[pos] = True
        starts_a = np.flatnonzero(keep)
        count = np.diff(np.concatenate((starts_a, [n])))
    if not (count > 1).any():
        return Template(lsub, loff, rsub, roff, lens, one, zero, zero)
    st = starts_a
    many = count > 1
    ls = np.where(many, dl[np.minimum(st, n - 2)], 0)
    rs = np.where(many, dr[np.minimum(st, n - 2)], 0)
    return Template(lsub[st], loff[st], rsub[st], roff[st], lens[st], count.astype(np.int64), ls, rs)


def template(local: LayerGeom, remote: LayerGeom, lh0: int, rh0: int, nh: int) -> Template:
    """Pieces moving heads ``rh0..`` of ``remote`` into heads ``lh0..`` of ``local`` for one super
    block (``max(block sizes)`` tokens), merged wherever both sides are contiguous."""
    if local.planes != remote.planes or local.cell != remote.cell:
        raise kvx.ProtocolError(f"layer {local.name}: cells differ (prefill {remote.planes}x{remote.cell} bytes, "
                                f"decode {local.planes}x{local.cell} bytes)")
    bl, br = local.block_size, remote.block_size
    big = max(bl, br)
    if big % min(bl, br):
        raise kvx.ProtocolError(f"layer {local.name}: block sizes do not divide (prefill {br}, decode {bl})")
    if lh0 + nh > local.heads or rh0 + nh > remote.heads:
        raise kvx.ProtocolError(f"layer {local.name}: head range outside a rank's heads")
    t = np.arange(big, dtype=np.int64)
    shape = (local.planes, big, nh)
    lsub = np.broadcast_to((t // bl)[None, :, None], shape).reshape(-1)
    rsub = np.broadcast_to((t // br)[None, :, None], shape).reshape(-1)
    loff = local.offsets(t % bl, lh0, nh).reshape(-1)
    roff = remote.offsets(t % br, rh0, nh).reshape(-1)
    order = np.lexsort((loff, lsub))
    lsub, loff, rsub, roff = lsub[order], loff[order], rsub[order], roff[order]
    c = local.cell
    cont = ((lsub[1:] == lsub[:-1]) & (loff[1:] == loff[:-1] + c)
            & (rsub[1:] == rsub[:-1]) & (roff[1:] == roff[:-1] + c))
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    lens = np.diff(np.concatenate((starts, [lsub.size]))) * c
    return _strided(lsub[starts], loff[starts], rsub[starts], roff[starts], lens.astype(np.int64))


def pair_blocks(local_ids: np.ndarray, local_pos: np.ndarray, remote_ids: np.ndarray, bl: int, br: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """Pair a request's new local blocks (ids at block positions ``local_pos``) with the prefill's
    blocks (all of the request's, in order) per super block: ``(lblock [S, kl], rblock [S, kr])``,
    -1 where a sub-block is absent (already local, or past the request's end)."""
    lids = np.asarray(local_ids, dtype=np.int64)
    lpos = np.asarray(local_pos, dtype=np.int64)
    rids = np.asarray(remote_ids, dtype=np.int64)
    if bl >= br:
        k = bl // br
        rpos = lpos[:, None] * k + np.arange(k, dtype=np.int64)[None, :]
        ok = rpos < rids.size
        rblock = np.where(ok, rids[np.minimum(rpos, max(rids.size - 1, 0))] if rids.size else -1, -1)
        if lids.size and not ok[:, 0].all():
            raise kvx.ProtocolError("the prefill instance lists fewer blocks than the request needs")
        return lids[:, None], rblock
    k = br // bl
    q = lpos // k
    uq, inv = np.unique(q, return_inverse=True)
    if uq.size and int(uq[-1]) >= rids.size:
        raise kvx.ProtocolError("the prefill instance lists fewer blocks than the request needs")
    lblock = np.full((uq.size, k), -1, dtype=np.int64)
    lblock[inv.reshape(-1), lpos % k] = lids
    return lblock, rids[uq][:, None]


class PeerTables:
    """The descriptor lists of one (local rank, remote rank) pair, built once per peer.

    Parameters
    ----------
    local, remote
        Both sides' layers (matched by name; every local layer needs its remote twin).
    lh0, rh0, nh
        The heads read: ``nh`` heads from ``rh0`` of the remote rank into ``lh0..`` locally.
    kind, dev, rkind, rdev
        Memory kind and device of each side.
    """

    def __init__(self, local: list[LayerGeom], remote: list[LayerGeom], lh0: int, rh0: int, nh: int,
                 kind: kvx.MemoryKind, dev: int, rkind: kvx.MemoryKind, rdev: int) -> None:
        rmap = {g.name: g for g in remote}
        if len(rmap) != len(remote):
            raise kvx.ProtocolError("the prefill instance lists a layer twice")
        missing = [g.name for g in local if g.name not in rmap]
        if missing:
            raise kvx.ProtocolError(f"the prefill instance has no layer {missing[0]!r} ({len(missing)} missing)")
        self.layers = local
        self.remote = [rmap[g.name] for g in local]
        self.templates = [template(lg, rg, lh0, rh0, nh) for lg, rg in zip(local, self.remote)]
        for side, geoms in (("decode", local), ("prefill", self.remote)):
            total = sum(g.num_blocks * len(t) for g, t in zip(geoms, self.templates))
            if total > MAX_DESCS:
                raise kvx.ProtocolError(f"the {side} side's descriptor list would hold {total} entries "
                                        f"(more than {MAX_DESCS})")
        la: list[np.ndarray] = []
        ra: list[np.ndarray] = []
        ln: list[np.ndarray] = []
        rn: list[np.ndarray] = []
        lc: list[np.ndarray] = []
        rc: list[np.ndarray] = []
        lst: list[np.ndarray] = []
        rst: list[np.ndarray] = []
        self.loffs, self.roffs = [], []
        nl = nr = 0
        strided = any(tp.strided for tp in self.templates)
        for lg, rg, tp in zip(local, self.remote, self.templates):
            p = len(tp)
            self.loffs.append(nl)
            self.roffs.append(nr)
            lb = np.arange(lg.num_blocks, dtype=np.int64)[:, None]
            rb = np.arange(rg.num_blocks, dtype=np.int64)[:, None]
            la.append((lg.base + lb * lg.block_stride + tp.loff[None, :]).reshape(-1))
            ra.append((rg.base + rb * rg.block_stride + tp.roff[None, :]).reshape(-1))
            for out, v, nb in ((ln, tp.nbytes, lg.num_blocks), (rn, tp.nbytes, rg.num_blocks),
                               (lc, tp.count, lg.num_blocks), (rc, tp.count, rg.num_blocks),
                               (lst, tp.lstride, lg.num_blocks), (rst, tp.rstride, rg.num_blocks)):
                if strided or out is ln or out is rn:
                    out.append(np.broadcast_to(v[None, :], (nb, p)).reshape(-1))
            nl += lg.num_blocks * p
            nr += rg.num_blocks * p

        def cat(parts: list[np.ndarray]) -> np.ndarray:
            return np.concatenate(parts).astype(_U64)

        try:
            if strided:
                self.local_descs = kvx.DescList.strided(kind=kind, addr=cat(la), nbytes=cat(ln), count=cat(lc),
                                                        stride=cat(lst), dev=dev)
                self.remote_descs = kvx.DescList.strided(kind=rkind, addr=cat(ra), nbytes=cat(rn), count=cat(rc),
                                                         stride=cat(rst), dev=rdev)
            else:
                self.local_descs = kvx.DescList.from_arrays(kind=kind, addr=cat(la), nbytes=cat(ln), dev=dev)
                self.remote_descs = kvx.DescList.from_arrays(kind=rkind, addr=cat(ra), nbytes=cat(rn), dev=rdev)
        except kvx.UsageError as exc:  # a peer's geometry that describes no memory kvx can address
            raise kvx.ProtocolError(f"the prefill instance's layers cannot be described: {exc}") from None
        # layers alike for indexing (same group, block sizes, block counts and template) form one
        # set: a request's indices are then one row per super block, computed once per set and
        # offset per layer by a single broadcast add (typically all layers are one set)
        members: dict[tuple[Any, ...], list[tuple[LayerGeom, LayerGeom, Template, int, int]]] = {}
        for lg, rg, tp, lo, ro in zip(local, self.remote, self.templates, self.loffs, self.roffs):
            key = (lg.group, lg.block_size, rg.block_size, lg.num_blocks, rg.num_blocks, tp.lsub.tobytes(),
                   tp.rsub.tobytes())
            members.setdefault(key, []).append((lg, rg, tp, lo, ro))
        self._sets: list[_LayerSet] = []
        for m in members.values():
            lg, rg, tp, _lo, _ro = m[0]
            self._sets.append(_LayerSet(lg.group, lg.block_size, rg.block_size, lg.num_blocks, rg.num_blocks, tp,
                                        not tp.lsub.any() and not tp.rsub.any(),
                                        np.array([x[3] for x in m], dtype=np.int64),
                                        np.array([x[4] for x in m], dtype=np.int64), lg.name))

    @property
    def pieces(self) -> int:
        """Pieces per super block, summed over layers."""
        return sum(len(t) for t in self.templates)

    def indices(self, groups: list[tuple[np.ndarray, np.ndarray, np.ndarray]]
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Indices into ``(local_descs, remote_descs)`` for a request, and the remote blocks read.

        ``groups[g]`` is ``(local new block ids, their block positions, all remote block ids)`` of KV
        cache group ``g``. Work is a few numpy passes over the result (no per-layer or per-block
        Python loop): one row of indices per super block and layer set, then one broadcast add of
        the layers' list offsets.
        """
        lout, rout, used = [], [], []
        pairs: dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray]] = {}
        checked: set[tuple[int, int, int, int, int]] = set()
        for st in self._sets:
            if st.group >= len(groups):
                continue
            lids, lpos, rids = groups[st.group]
            if not len(lids):
                continue
            key = (st.group, st.bl, st.br)
            if key not in pairs:
                pairs[key] = pair_blocks(lids, lpos, rids, st.bl, st.br)
            lblock, rblock = pairs[key]
            ck = (*key, st.nbl, st.nbr)
            if ck not in checked:
                if lblock.size and (lblock.max() >= st.nbl or rblock.max() >= st.nbr or rblock.min() < -1):
                    raise kvx.ProtocolError(f"layer {st.name}: block id out of range")
                checked.add(ck)
            tp = st.tp
            n = len(tp)
            p = np.arange(n, dtype=np.int64)[None, :]
            if st.flat and lblock.shape[1] == 1 and rblock.shape[1] == 1 and (
                    not lblock.size or (lblock.min() >= 0 and rblock.min() >= 0)):
                # equal block sizes, every block present: each super block is one whole row
                lrow = (lblock * n + p).reshape(-1)
                rrow = (rblock * n + p).reshape(-1)
                used.append(rblock.reshape(-1))
            else:
                lb = lblock[:, tp.lsub]
                rb = rblock[:, tp.rsub]
                ok = (lb >= 0) & (rb >= 0)
                lrow = (lb * n + p)[ok]
                rrow = (rb * n + p)[ok]
                used.append(rb[ok])
            lout.append((st.lo[:, None] + lrow[None, :]).reshape(-1))
            rout.append((st.ro[:, None] + rrow[None, :]).reshape(-1))
        if not lout:
            return np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.int64)
        if len(lout) == 1:
            return lout[0], rout[0], np.unique(used[0])
        return np.concatenate(lout), np.concatenate(rout), np.unique(np.concatenate(used))


@dataclass(frozen=True, slots=True)
class _LayerSet:
    """Layers of a :class:`PeerTables` indexed alike: their list offsets ``lo``/``ro`` (per layer)."""

    group: int
    bl: int
    br: int
    nbl: int
    nbr: int
    tp: Template
    flat: bool  # every piece in sub-block 0 on both sides (equal block sizes)
    lo: np.ndarray
    ro: np.ndarray
    name: str  # of its first layer (for errors)
