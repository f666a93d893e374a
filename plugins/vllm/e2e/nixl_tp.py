"""NIXL moving head slices across TP sizes the way vLLM's NixlConnector plans them (HND only).

``bench_tp_gpu.py --compare nixl`` runs these ranks beside kvx's: every TP rank is a process of its
own holding the same HND cache (``[blocks, heads, block_size, 2 * head_dim]`` per layer, K and V in
the content dimension, as vLLM 0.32 keeps it) with one NIXL agent on the UCX backend
(``nixl_agent_config(num_threads=4, capture_telemetry=True)``, as NixlConnector makes it), every
layer's cache registered once (``VRAM`` on GPUs, ``DRAM`` on CPU). Descriptor lists are prepared
once per peer and each request is one ``make_prepped_xfer("READ", ...)`` per (decode rank, prefill
rank) pair with the notification NixlConnector sends (``"<request>:<consumers>"``), posted with
``transfer`` and polled with ``check_xfer_state`` until DONE.

The descriptors follow NixlConnector (vllm ``distributed/kv_transfer/kv_connector/v1/nixl``,
``base_worker.py``: ``_build_fa_local``, ``_build_fa_remote``, ``_build_local_splits_from_plan``,
``_compute_desc_ids``; ``tp_mapping.py``: ``compute_tp_mapping``) for one attention group, one
region per layer, equal block sizes:

- local: one descriptor per (layer, block), the whole local block;
- remote, decode TP >= prefill TP: one per (layer, block) of the one source rank, this rank's head
  slice (``rank_offset_factor`` local blocks into the remote block), a local block long;
- remote, prefill TP > decode TP: one per (layer, block) of each source rank, the whole remote
  block, read into that rank's slot of the local block (a local list split per source rank);
- descriptor ids: ``layer * num_blocks + block``.

``plugins/vllm/tests/test_nixl_tp.py`` checks these functions against vLLM's own methods.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import tarfile
import time
import uuid
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Sequence

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
#: what ``scripts/gpu_carry.sh`` packs (nixl-cu13 + libucx-cu13 for Python 3.12) and where it unpacks
CARRY = os.path.join(ROOT, ".carry", "gpu-site.tar.xz")
SITE = os.path.join(ROOT, "build", "gpu-site")
INSTALL_HINT = ("pip install nixl-cu13==1.5.1 (or nixl-cu12), or on a machine without network: "
                "`bash scripts/gpu_carry.sh` where pip works, carry .carry/ over (this script unpacks "
                ".carry/gpu-site.tar.xz into build/gpu-site)")


# ---------------------------------------------------------------------------------------------
# NIXL's descriptor plan (pure numpy; unit-tested against vLLM's code)

@dataclass(frozen=True, slots=True)
class TPPlan:
    """What one decode rank reads (vLLM's ``TPMapping`` for one attention group, no DCP).

    ``source_ranks``: the prefill ranks it reads, in slot order; ``slots``: each source rank's slot
    in the local block when several are read; ``rank_offset_factor``: how many local blocks into a
    remote block this rank's heads start (decode TP > prefill TP); ``consumers``: how many decode
    ranks read each prefill rank (the prefill frees after that many notifications).
    """

    source_ranks: tuple[int, ...]
    slots: dict[int, int]
    rank_offset_factor: int
    consumers: int


def tp_plan(tp: int, rank: int, remote_tp: int, total_heads: int) -> TPPlan:
    """The prefill ranks decode rank ``rank`` of ``tp`` reads from a prefill engine of ``remote_tp``
    ranks holding ``total_heads`` KV heads (NixlConnector's ``compute_tp_mapping``, non-MLA)."""
    if tp <= 0 or remote_tp <= 0 or not 0 <= rank < tp:
        raise ValueError(f"bad TP shape: rank {rank} of {tp}, remote tp {remote_tp}")
    if max(tp, remote_tp) % min(tp, remote_tp):
        raise ValueError(f"TP sizes {tp} and {remote_tp} do not divide")
    if tp >= remote_tp:
        ranks = [rank * remote_tp // tp]
    else:  # one decode rank reads several prefill ranks; replicated heads are read once
        k = remote_tp // tp
        heads = np.arange(rank * k, rank * k + k) * total_heads // remote_tp
        _, first = np.unique(heads, return_index=True)
        ranks = (rank * k + np.sort(first)).tolist()
    head_slot = {r * total_heads // remote_tp: i for i, r in enumerate(ranks)}
    slots = {r: head_slot.get(r * total_heads // remote_tp, 0) for r in ranks}
    if tp <= remote_tp:
        factor = 0
    elif tp > total_heads:
        factor = rank * total_heads // tp - ranks[0] * total_heads // remote_tp
    else:
        factor = rank % (tp // remote_tp)
    return TPPlan(tuple(ranks), slots, factor, max(1, tp // remote_tp))


def _stack(addrs: np.ndarray, length: int, dev: int) -> np.ndarray:
    out = np.empty((len(addrs), 3), dtype=np.uint64)
    out[:, 0] = addrs
    out[:, 1] = length
    out[:, 2] = dev
    return out


def local_descs(bases: Sequence[int], block_len: int, stride: int, num_blocks: int, dev: int) -> np.ndarray:
    """Nx3 ``(addr, len, dev)``: every local block of every layer, layer-major."""
    b = np.arange(num_blocks, dtype=np.uint64) * np.uint64(stride)
    return np.concatenate([_stack(np.uint64(base) + b, block_len, dev) for base in bases])


def remote_descs(bases: Sequence[int], local_block_len: int, stride: int, num_blocks: int, dev: int,
                 plan: TPPlan) -> np.ndarray:
    """Nx3: every block of every layer of one source rank, as this decode rank reads it: a local
    block long at this rank's head offset, or, reading several ranks, one slot of a local block."""
    length = local_block_len // len(plan.source_ranks)
    off = np.uint64(plan.rank_offset_factor * local_block_len)
    b = np.arange(num_blocks, dtype=np.uint64) * np.uint64(stride)
    return np.concatenate([_stack(np.uint64(base) + off + b, length, dev) for base in bases])


def local_split(descs: np.ndarray, nsplit: int, slot: int) -> np.ndarray:
    """The local list one source rank's reads land in: slot ``slot`` of ``nsplit`` of every block."""
    out = descs.copy()
    chunk = out[:, 1] // np.uint64(nsplit)
    out[:, 0] += np.uint64(slot) * chunk
    out[:, 1] = chunk
    return out


def desc_ids(block_ids: Sequence[int] | np.ndarray, num_layers: int, num_blocks: int) -> np.ndarray:
    """Descriptor ids of ``block_ids`` in every layer, layer-major (int64)."""
    ids = np.asarray(block_ids, dtype=np.int64)
    return (np.arange(num_layers, dtype=np.int64)[:, None] * num_blocks + ids[None, :]).ravel()


# ---------------------------------------------------------------------------------------------
# NIXL availability

def import_nixl() -> ModuleType:
    """NIXL's Python API (``nixl_cu13._api``, ``nixl_cu12._api`` or ``nixl._api``); unpacks the
    carried ``.carry/gpu-site.tar.xz`` into ``build/gpu-site`` first when NIXL is not installed."""
    import importlib

    errors = []
    for attempt in range(2):
        for name in ("nixl_cu13._api", "nixl_cu12._api", "nixl._api"):
            try:
                return importlib.import_module(name)
            except Exception as exc:  # ImportError, or a missing shared library (OSError)
                errors.append(f"{name}: {type(exc).__name__}: {exc}")
        if attempt or not (os.path.isdir(SITE) or os.path.isfile(CARRY)):
            break
        if not os.path.isdir(SITE):
            with tarfile.open(CARRY) as t:
                t.extractall(os.path.dirname(SITE), filter="data")
        sys.path.insert(0, SITE)
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (SITE, os.environ.get("PYTHONPATH")) if p)
        importlib.invalidate_caches()
    raise RuntimeError(f"NIXL is not importable ({'; '.join(errors)}); {INSTALL_HINT}")


# ---------------------------------------------------------------------------------------------
# one rank (a process of its own; the same command protocol as bench_tp_gpu's kvx ranks)

def nixl_version() -> str:
    """The installed or carried NIXL wheel's version ("unknown" when not found)."""
    from importlib import metadata

    for dist in ("nixl-cu13", "nixl-cu12", "nixl"):
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def nixl_rank(conn: Any, o: dict[str, Any]) -> None:
    """One TP rank with a NIXL agent: prefill ranks register and fill, decode ranks read."""
    import torch

    sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.dirname(HERE))
    from bench_tp_gpu import cells, request_kv, token_places
    from kvx_vllm.plan import heads_of

    if o["layout"] != "HND":
        raise ValueError(f"NixlConnector plans TP mismatch for HND only, not {o['layout']}")
    api = import_nixl()
    dev = torch.device("cuda", o["gpu"]) if o["device"] == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)  # UCX's cuda_ipc uses this thread's context
    L, H, D, bs, nb, tp, rank = (o["layers"], o["heads"], o["head_dim"], o["block"], o["blocks"], o["tp"],
                                 o["rank"])
    h0, nh = heads_of(H, tp, rank)
    caches = [torch.zeros(nb, nh, bs, 2 * D, dtype=torch.bfloat16, device=dev) for _ in range(L)]
    mem = "VRAM" if dev.type == "cuda" else "DRAM"
    devid = dev.index or 0
    block_len = caches[0][0].nbytes
    stride = caches[0].stride(0) * caches[0].element_size()
    bases = [int(c.data_ptr()) for c in caches]
    agent = api.nixl_agent(f"{o['engine']}-{rank}-{uuid.uuid4().hex[:8]}",
                           api.nixl_agent_config(num_threads=4, capture_telemetry=True))
    reg = agent.register_memory(agent.get_reg_descs([(b, c.nbytes, devid, "") for b, c in zip(bases, caches)],
                                                    mem), backends=["UCX"])
    mine = local_descs(bases, block_len, stride, nb, devid)
    whole = agent.prep_xfer_dlist("NIXL_INIT_AGENT", agent.get_xfer_descs(mine, mem))
    hello = {"md": base64.b64encode(agent.get_agent_metadata()).decode(), "bases": bases, "stride": stride,
             "blocks": nb, "dev": devid, "rank": rank}
    conn.send_bytes(json.dumps({"ready": True, "hs": hello}).encode())
    # per prefill engine: [(local dlist, remote dlist, remote agent)] in slot order, and the plan
    peers: dict[str, tuple[list[tuple[Any, Any, str]], TPPlan, int]] = {}
    lists: list[Any] = [whole]
    while True:
        cmd = json.loads(conn.recv_bytes())
        c = cmd["cmd"]
        if c == "fill":
            blk, pos = token_places(cmd["blocks"], cmd["tokens"], bs, dev)
            for i, t in enumerate(caches):
                kv = request_kv(i, cmd["tokens"], cmd["seed"], 2, H, D, dev)
                cells("HND", t, D)[blk, :, pos] = kv[:, :, h0:h0 + nh]
            if dev.type == "cuda":
                torch.cuda.synchronize()
            conn.send_bytes(json.dumps({"ok": True}).encode())
        elif c == "connect":  # decode: descriptor lists of a prefill engine, once
            if cmd["engine"] not in peers:
                plan = tp_plan(tp, rank, cmd["tp"], H)
                pairs = []
                for r in plan.source_ranks:
                    p = cmd["workers"][str(r)]
                    name = agent.add_remote_agent(base64.b64decode(p["md"]))
                    name = name.decode() if isinstance(name, bytes) else name
                    theirs = remote_descs(p["bases"], block_len, p["stride"], p["blocks"], p["dev"], plan)
                    remote = agent.prep_xfer_dlist(name, agent.get_xfer_descs(theirs, mem))
                    local = whole
                    if len(plan.source_ranks) > 1:
                        local = agent.prep_xfer_dlist(
                            "NIXL_INIT_AGENT",
                            agent.get_xfer_descs(local_split(mine, len(plan.source_ranks), plan.slots[r]), mem))
                        lists.append(local)
                    lists.append(remote)
                    pairs.append((local, remote, name))
                peers[cmd["engine"]] = (pairs, plan, cmd["workers"][str(plan.source_ranks[0])]["blocks"])
            conn.send_bytes(json.dumps({"ok": True}).encode())
        elif c == "pull":  # decode: one READ per source rank, timed post -> all DONE
            pairs, plan, remote_nb = peers[cmd["engine"]]
            lids = desc_ids(cmd["blocks"], L, nb)
            rids = desc_ids(cmd["remote"], L, remote_nb)
            notif = f"{cmd['rid']}:{plan.consumers}".encode()
            failed = ""
            t0 = time.perf_counter()
            handles = [agent.make_prepped_xfer("READ", lh, lids, rh, rids, notif_msg=notif) for lh, rh, _n in pairs]
            for h in handles:
                if agent.transfer(h) == "ERR":
                    failed = "transfer posted ERR"
            post = time.perf_counter() - t0
            todo = list(handles)
            limit = t0 + 300
            while todo and not failed:
                s = agent.check_xfer_state(todo[-1])
                if s == "DONE":
                    todo.pop()
                elif s == "ERR":
                    failed = "check_xfer_state ERR"
                elif time.perf_counter() > limit:
                    failed = "not DONE within 300 s"
            el = time.perf_counter() - t0
            for h in handles:
                agent.release_xfer_handle(h)
            ok = None
            if cmd.get("verify") and not failed:
                blk, pos = token_places(cmd["blocks"], cmd["tokens"], bs, dev)
                ok = all(torch.equal(cells("HND", t, D)[blk, :, pos],
                                     request_kv(i, cmd["tokens"], cmd["seed"], 2, H, D, dev)[:, :, h0:h0 + nh])
                         for i, t in enumerate(caches))
            conn.send_bytes(json.dumps({"s": el, "post_s": post, "failed": [failed] if failed else [], "ok": ok,
                                        "bytes": cmd["tokens"] * 2 * nh * D * 2 * L}).encode())
        elif c == "poll":  # prefill: take the decode ranks' notifications
            n = sum(len(v) for v in agent.get_new_notifs().values())
            conn.send_bytes(json.dumps({"notifs": n}).encode())
        elif c == "quit":
            for d in reversed(lists):
                agent.release_dlist_handle(d)
            agent.deregister_memory(reg, backends=["UCX"])
            conn.send_bytes(b"{}")
            return
