"""Attention-TP ranks (prefill or decode) of PD pairs of different TP sizes, through SGLang's classes.

Run by tests/test_pd_tp.py: ``python tp_proc.py worker 0 MODEL``, a worker that plays one rank per
scenario, scenarios one after another (SGLang is imported once per worker: the CI time). Each
scenario is a JSON line on stdin, ``{"role", "port", "tp", "rank", "kind", "heads"}`` (kind
``mha`` or ``mla``; heads: KV heads of the whole model); ``done`` on stdin ends it (the manager
and bootstrap server are closed) and the worker waits for the next. For a scenario the worker
publishes SGLang's runtime context for ``--tp-size TP`` at world rank RANK, builds SGLang's own KV
pool on CPU (``MHATokenToKVPool``: this rank's heads of every layer's K and V;
``MLATokenToKVPool``: the whole latent) and real ``MetadataBuffers``, and gets the
manager/sender/receiver/bootstrap server from ``get_kv_class`` with
``--disaggregation-transfer-backend kvx``.

Every KV buffer's bytes come from a model-wide tensor ``[tokens, HEADS, dim]`` of one seed (MLA:
``[tokens, 1, latent]``); a rank holds its heads of it. What a decode rank must receive for a
page is therefore the prefill page's bytes at the heads the decode rank holds -- what a prefill of
the decode's own TP size would deliver -- and decode checks exactly that, byte for byte, and
that no other page changed.

Rooms: 1 moves SRC_PAGES -> DST_PAGES and the aux row; 2 is aborted by decode after its page
list went out (both sides Failed, with a reason).
"""

from __future__ import annotations

import json
import os
import sys
import time

from proc_common import BOUND, aux_buffers, aux_tensors, wait_for

T0 = time.monotonic()
MODEL = sys.argv[-1]
ROLE, PORT, TP, RANK, KIND, HEADS = "", 0, 1, 0, "mha", 1
HOLD = VICTIM = False  # dead-peer scenario: prefill waits for "send" after bootstrap; a victim decode dies
os.environ["SGLANG_HOST_IP"] = "127.0.0.1"

LAYERS, DIM, PAGE, TOKENS = 3, 16, 4, 128
LORA, ROPE = 64, 16
SRC_PAGES = [2, 5, 7, 9, 20, 31]
DST_PAGES = [10, 11, 12, 13, 30, 1]
SRC_AUX, DST_AUX = 1, 3


def say(**kw: object) -> None:
    print(json.dumps(dict(kw, t=round(time.monotonic() - T0, 2))), flush=True)


def model_tensor(seed: int, buf: int, shape: tuple[int, ...]):
    """The model-wide bytes of KV buffer ``buf`` (int16 view of bf16)."""
    import torch

    g = torch.Generator().manual_seed(seed * 1000 + buf)
    return torch.randint(-30000, 30000, shape, dtype=torch.int16, generator=g)


def heads_of(tp: int, rank: int) -> tuple[int, int]:
    per, rep = max(1, HEADS // tp), max(1, tp // HEADS)
    return (rank // rep) * per, per


def pool_buffers(pool) -> list:
    """The pool's KV tensors in the order of get_contiguous_buf_infos."""
    ptrs = pool.get_contiguous_buf_infos()[0]
    tensors = list(pool.k_buffer) + list(pool.v_buffer) if KIND == "mha" else list(pool.kv_buffer)
    assert [t.data_ptr() for t in tensors] == list(ptrs)
    return tensors


def fill_pool(pool, seed: int, tp: int, rank: int) -> None:
    h0, n = heads_of(tp, rank)
    for b, t in enumerate(pool_buffers(pool)):
        rows = t.shape[0]
        full = model_tensor(seed, b, (rows, HEADS, DIM) if KIND == "mha" else (rows, 1, LORA + ROPE))
        t.view(torch_int16()).copy_(full[:, h0:h0 + n] if KIND == "mha" else full)


def torch_int16():
    import torch

    return torch.int16


def main() -> None:
    global ROLE, PORT, TP, RANK, KIND, HEADS, HOLD, VICTIM, DIM
    from sglang.srt.plugins import load_plugins

    load_plugins()
    say(event="imported")
    for line in sys.stdin:
        if not line.strip():
            continue
        sc = json.loads(line)
        ROLE, PORT, TP, RANK, KIND, HEADS = sc["role"], sc["port"], sc["tp"], sc["rank"], sc["kind"], sc["heads"]
        HOLD, VICTIM = bool(sc.get("hold")), bool(sc.get("victim"))
        DIM = int(sc.get("dim", 16))  # another head size on one side: pools that do not pair
        scenario()


def scenario() -> None:
    from types import SimpleNamespace

    import numpy as np
    import torch
    from sglang.srt import runtime_context as rc
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType, TransferBackend, get_kv_class
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.server_args import ServerArgs

    prefill = ROLE == "prefill"
    sa = ServerArgs(model_path=MODEL, device="cpu", host="127.0.0.1", skip_tokenizer_init=True, tp_size=TP,
                    disaggregation_mode=ROLE, disaggregation_transfer_backend="kvx",
                    disaggregation_bootstrap_port=PORT)
    rc.publish(sa, role="scheduler", ranks=rc.SpawnRanks(world_rank=RANK))
    rc.get_parallel().override_permanently(
        pp_group=SimpleNamespace(world_size=1, rank_in_group=0, is_first_rank=True, is_last_rank=True))
    backend = TransferBackend(sa.disaggregation_transfer_backend)
    if KIND == "mha":
        pool = MHATokenToKVPool(size=TOKENS, page_size=PAGE, dtype=torch.bfloat16, head_num=heads_of(TP, RANK)[1],
                                head_dim=DIM, layer_num=LAYERS, device="cpu", enable_memory_saver=False,
                                enable_alt_stream=False)
    else:
        pool = MLATokenToKVPool(size=TOKENS, page_size=PAGE, dtype=torch.bfloat16, kv_lora_rank=LORA,
                                qk_rope_head_dim=ROPE, layer_num=LAYERS, device="cpu", enable_memory_saver=False)
    seed = 1234 if prefill else 99
    fill_pool(pool, seed, TP, RANK)
    aux = aux_buffers(4321 if prefill else 77)
    args = get_kv_class(backend, KVClassType.KVARGS)()
    args.engine_rank = RANK
    args.pp_rank = 0
    args.system_dp_rank = 0
    args.rust_http_port = None
    args.kv_cache_dtype_str = "bfloat16"
    args.kv_layout = None
    args.prefill_start_layer = 0
    args.prefill_end_layer = LAYERS
    args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = pool.get_contiguous_buf_infos()
    args.kv_layer_ids = list(range(LAYERS)) * (2 if KIND == "mha" else 1)
    args.num_draft_entries = 0
    args.kv_head_num = heads_of(TP, RANK)[1] if KIND == "mha" else 1
    args.total_kv_head_num = HEADS if KIND == "mha" else 1
    args.page_size = PAGE
    args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = aux.get_buf_infos()
    args.ib_device = None
    args.gpu_id = 0
    args.state_types, args.state_data_ptrs, args.state_data_lens, args.state_item_lens = [], [], [], []
    args.state_layer_ids, args.state_dim_per_tensor, args.state_slice_outer_counts = [], [], []
    args.state_conv_shard_groups = []
    args.is_hybrid_mla_backend = False
    args.swa_kv_cache_layout = None
    args.mla_compression_ratios = None
    mode = DisaggregationMode.PREFILL if prefill else DisaggregationMode.DECODE
    addr = f"127.0.0.1:{PORT}"
    mla = KIND == "mla"
    server = None
    if prefill:
        if RANK == 0:
            server = get_kv_class(backend, KVClassType.BOOTSTRAP_SERVER)(host="127.0.0.1", port=PORT)
        mgr = get_kv_class(backend, KVClassType.MANAGER)(args, mode, sa, mla)
        say(event="ready", server=server is not None)
        sender_cls = get_kv_class(backend, KVClassType.SENDER)
        senders = {room: sender_cls(mgr, addr, room) for room in (1, 2)}
        s = senders[1]
        st, _ = wait_for(s.poll, (KVPoll.WaitingForInput, KVPoll.Failed), "room 1 bootstrap")
        if st == KVPoll.WaitingForInput:
            if HOLD:
                say(event="waiting", room=1)
                assert sys.stdin.readline().strip() == "send"
            t1 = time.monotonic()
            s.init(len(SRC_PAGES), SRC_AUX)
            s.send(np.array(SRC_PAGES, dtype=np.int32))
            st, _ = wait_for(s.poll, (KVPoll.Success, KVPoll.Failed), "room 1 transfer")
            dt = time.monotonic() - t1
        modes = sorted(p.pair.mode.value for p in mgr._peers.values() if p.pair is not None)
        say(event="room", room=1, state=int(st), seconds=dt, reason=mgr.failure_records.get(1), modes=modes,
            pages_sent=mgr.pages_sent)
        st, dt = wait_for(senders[2].poll, (KVPoll.Failed,), "room 2 decode abort")
        say(event="room", room=2, state=int(st), seconds=dt, reason=mgr.failure_records.get(2))
        assert sys.stdin.readline().strip() == "done"
    else:
        mgr = get_kv_class(backend, KVClassType.MANAGER)(args, mode, sa, mla)
        t0 = time.monotonic()
        while not mgr.try_ensure_parallel_info(addr):
            if time.monotonic() - t0 > BOUND:
                raise TimeoutError("prefill bootstrap info never appeared")
            time.sleep(0.2)
        say(event="ready")
        recv_cls = get_kv_class(backend, KVClassType.RECEIVER)
        bufs = pool_buffers(pool)
        before = [t.clone() for t in bufs]
        r = recv_cls(mgr, addr, 1)
        r.init(0)
        r.send_metadata(np.array(DST_PAGES, dtype=np.int32), DST_AUX)
        if VICTIM:
            say(event="waiting", room=1)
            time.sleep(3600)  # the test kills this process
        st, dt = wait_for(r.poll, (KVPoll.Success, KVPoll.Failed), "room 1 transfer")
        h0, n = heads_of(TP, RANK)
        kv_ok = True
        for b, t in enumerate(bufs):
            rows = t.shape[0]
            full = model_tensor(1234, b, (rows, HEADS, DIM) if KIND == "mha" else (rows, 1, LORA + ROPE))
            mine = full[:, h0:h0 + n] if KIND == "mha" else full  # what a prefill of this TP size holds
            got = t.view(torch.int16)
            for sp, dp in zip(SRC_PAGES, DST_PAGES):
                kv_ok &= torch.equal(got[dp * PAGE:(dp + 1) * PAGE], mine[sp * PAGE:(sp + 1) * PAGE])
        others = [p for p in range(TOKENS // PAGE) if p not in DST_PAGES]
        untouched = all(torch.equal(t.view(torch.int16).view(-1, PAGE * t[0].numel())[others],
                                    o.view(torch.int16).view(-1, PAGE * t[0].numel())[others])
                        for t, o in zip(bufs, before))
        mine_aux, theirs = aux_tensors(aux), aux_tensors(aux_buffers(4321))
        aux_ok = all(torch.equal(a[DST_AUX].view(torch.uint8), b[SRC_AUX].view(torch.uint8))
                     for a, b in zip(mine_aux, theirs))
        unchanged = all(torch.equal(t.view(torch.int16), o.view(torch.int16)) for t, o in zip(bufs, before))
        say(event="room", room=1, state=int(st), seconds=dt, kv_ok=kv_ok, aux_ok=aux_ok, untouched=untouched,
            unchanged=unchanged, reason=mgr.failure_records.get(1))
        r2 = recv_cls(mgr, addr, 2)
        r2.init(0)
        r2.send_metadata(np.array(DST_PAGES[:2], dtype=np.int32), 0)
        r2.abort()
        say(event="room", room=2, state=int(r2.poll()), reason=mgr.failure_records.get(2))
        assert sys.stdin.readline().strip() == "done"
    mgr.close()
    if server is not None:
        server.close()
    say(event="closed")


if __name__ == "__main__":
    main()
