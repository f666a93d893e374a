"""One side (prefill or decode) of a PD transfer through SGLang's own classes and the kvx backend.

Run by tests/test_pd.py as a separate process: ``python pd_proc.py ROLE BOOTSTRAP_PORT MODEL_DIR``.
SGLang's plugins are loaded as SGLang loads them (``load_plugins``), the runtime context is
published from real ``ServerArgs`` with ``--disaggregation-transfer-backend kvx``, and the
manager/sender/receiver/bootstrap server come from ``get_kv_class``. KV buffers are CPU tensors
laid out as SGLang's MHA pool gives them to a transfer backend (one buffer per layer and K/V,
one item per page); the aux rows come from SGLang's real ``MetadataBuffers``. Progress goes to
stdout as one JSON object per line.

Rooms: 1 moves pages and an aux row (decode checks them byte for byte); 2 is aborted by decode
after its metadata went out; 3 is aborted by prefill; 5 belongs to a second decode process
(``victim``) that the test kills before prefill sends; 4 waits until the test kills the prefill.
"""

from __future__ import annotations

import os
import sys
import time

from proc_common import BOUND, aux_buffers, aux_tensors, say, wait_for

ROLE, PORT, MODEL = sys.argv[1], int(sys.argv[2]), sys.argv[3]
VICTIM = len(sys.argv) > 4 and sys.argv[4] == "victim"  # a second decode, killed by the test
os.environ["SGLANG_HOST_IP"] = "127.0.0.1"

LAYERS, HEADS, DIM, PAGE, PAGES = 3, 2, 16, 4, 32
SRC_PAGES = [2, 5, 7, 9, 20, 31]
DST_PAGES = [10, 11, 12, 13, 30, 1]
SRC_AUX, DST_AUX = 1, 3


def buffers(seed: int) -> list:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-100, 100, (PAGES * PAGE, HEADS, DIM), dtype=torch.int16, generator=g).view(torch.bfloat16)
            for _ in range(2 * LAYERS)]


def main() -> None:
    import numpy as np
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt import runtime_context as rc
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType, TransferBackend, get_kv_class
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs(model_path=MODEL, device="cpu", host="127.0.0.1", skip_tokenizer_init=True,
                    disaggregation_mode=ROLE, disaggregation_transfer_backend="kvx",
                    disaggregation_bootstrap_port=PORT)
    rc.publish(sa, role="scheduler", ranks=rc.SpawnRanks(world_rank=0))
    # The scheduler builds torch.distributed groups before the KV manager; with pp_size 1 the
    # manager only keeps the pipeline group, so a one-rank stand-in takes its place here.
    from types import SimpleNamespace

    rc.get_parallel().override_permanently(
        pp_group=SimpleNamespace(world_size=1, rank_in_group=0, is_first_rank=True, is_last_rank=True))
    backend = TransferBackend(sa.disaggregation_transfer_backend)
    prefill = ROLE == "prefill"
    kv = buffers(1234 if prefill else 99)
    aux = aux_buffers(4321 if prefill else 77)
    args = get_kv_class(backend, KVClassType.KVARGS)()
    args.engine_rank = 0
    args.pp_rank = 0
    args.system_dp_rank = 0
    args.rust_http_port = None
    args.kv_cache_dtype_str = "bfloat16"
    args.kv_layout = None
    args.prefill_start_layer = 0
    args.prefill_end_layer = LAYERS
    args.kv_data_ptrs = [t.data_ptr() for t in kv]
    args.kv_data_lens = [t.numel() * t.element_size() for t in kv]
    args.kv_item_lens = [PAGE * HEADS * DIM * 2] * len(kv)
    args.kv_layer_ids = list(range(LAYERS)) * 2
    args.num_draft_entries = 0
    args.kv_head_num = HEADS
    args.total_kv_head_num = HEADS
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
    if prefill:
        server = get_kv_class(backend, KVClassType.BOOTSTRAP_SERVER)(host="127.0.0.1", port=PORT)
        mgr = get_kv_class(backend, KVClassType.MANAGER)(args, mode, sa, False)
        say(event="ready", manager=type(mgr).__name__, server=type(server).__name__)
        sender_cls = get_kv_class(backend, KVClassType.SENDER)
        senders = {room: sender_cls(mgr, addr, room) for room in (1, 2, 3, 4, 5)}
        s = senders[1]
        st, _ = wait_for(s.poll, (KVPoll.WaitingForInput, KVPoll.Failed), "room 1 bootstrap")
        s.init(len(SRC_PAGES), SRC_AUX)
        s.send(np.array(SRC_PAGES, dtype=np.int32))
        st, dt = wait_for(s.poll, (KVPoll.Success, KVPoll.Failed), "room 1 transfer")
        say(event="room", room=1, state=int(st), seconds=dt)
        st, dt = wait_for(senders[2].poll, (KVPoll.Failed,), "room 2 decode abort")
        say(event="room", room=2, state=int(st), seconds=dt)
        wait_for(senders[3].poll, (KVPoll.WaitingForInput,), "room 3 bootstrap")
        senders[3].abort()
        say(event="room", room=3, state=int(senders[3].poll()), seconds=0.0)
        # room 5: its decode process is killed after sending its page list; the test says when
        wait_for(senders[5].poll, (KVPoll.WaitingForInput,), "room 5 bootstrap")
        say(event="waiting", room=5)
        assert sys.stdin.readline().strip() == "send"
        s5 = senders[5]
        s5.init(2, SRC_AUX)
        s5.send(np.array(SRC_PAGES[:2], dtype=np.int32))
        st, dt = wait_for(s5.poll, (KVPoll.Success, KVPoll.Failed), "room 5 dead decode")
        say(event="room", room=5, state=int(st), seconds=dt)
        wait_for(senders[4].poll, (KVPoll.WaitingForInput,), "room 4 bootstrap")
        say(event="waiting", room=4)
        time.sleep(3600)  # the test kills this process
    elif ROLE == "decode" and VICTIM:
        mgr = get_kv_class(backend, KVClassType.MANAGER)(args, mode, sa, False)
        t0 = time.monotonic()
        while not mgr.try_ensure_parallel_info(addr):
            if time.monotonic() - t0 > BOUND:
                raise TimeoutError("prefill bootstrap info never appeared")
            time.sleep(0.2)
        r5 = get_kv_class(backend, KVClassType.RECEIVER)(mgr, addr, 5)
        r5.init(0)
        r5.send_metadata(np.array(DST_PAGES[:2], dtype=np.int32), DST_AUX)
        say(event="waiting", room=5)
        time.sleep(3600)  # the test kills this process
    else:
        mgr = get_kv_class(backend, KVClassType.MANAGER)(args, mode, sa, False)
        t0 = time.monotonic()
        while not mgr.try_ensure_parallel_info(addr):
            if time.monotonic() - t0 > BOUND:
                raise TimeoutError("prefill bootstrap info never appeared")
            time.sleep(0.2)
        say(event="ready", manager=type(mgr).__name__)
        recv_cls = get_kv_class(backend, KVClassType.RECEIVER)
        import torch

        before = [t.clone() for t in kv]
        r = recv_cls(mgr, addr, 1)
        r.init(0)
        r.send_metadata(np.array(DST_PAGES, dtype=np.int32), DST_AUX)
        st, dt = wait_for(r.poll, (KVPoll.Success, KVPoll.Failed), "room 1 transfer")
        want_kv, want_aux = buffers(1234), aux_buffers(4321)
        def page(t, p):
            return t.view(PAGES, -1)[p].view(torch.int16)

        kv_ok = all(torch.equal(page(kv[b], d), page(want_kv[b], s))
                    for b in range(len(kv)) for s, d in zip(SRC_PAGES, DST_PAGES))
        others = [p for p in range(PAGES) if p not in DST_PAGES]
        untouched = all(torch.equal(kv[b].view(PAGES, -1)[others].view(torch.int16),
                                    before[b].view(PAGES, -1)[others].view(torch.int16)) for b in range(len(kv)))
        mine, theirs = aux_tensors(aux), aux_tensors(want_aux)
        aux_ok = all(torch.equal(a[DST_AUX].view(torch.uint8), b[SRC_AUX].view(torch.uint8))
                     for a, b in zip(mine, theirs))
        say(event="room", room=1, state=int(st), seconds=dt, kv_ok=kv_ok, aux_ok=aux_ok, untouched=untouched)
        r2 = recv_cls(mgr, addr, 2)
        r2.init(0)
        r2.send_metadata(np.array(DST_PAGES[:2], dtype=np.int32), 0)
        r2.abort()
        say(event="room", room=2, state=int(r2.poll()), seconds=0.0)
        r3 = recv_cls(mgr, addr, 3)
        r3.init(0)
        r3.send_metadata(np.array(DST_PAGES[:2], dtype=np.int32), 0)
        st, dt = wait_for(r3.poll, (KVPoll.Success, KVPoll.Failed), "room 3 prefill abort")
        say(event="room", room=3, state=int(st), seconds=dt)
        r4 = recv_cls(mgr, addr, 4)
        r4.init(0)
        r4.send_metadata(np.array(DST_PAGES[:2], dtype=np.int32), 0)
        say(event="waiting", room=4)
        st, dt = wait_for(r4.poll, (KVPoll.Success, KVPoll.Failed), "room 4 dead prefill")
        say(event="room", room=4, state=int(st), seconds=dt)
        mgr.close()


if __name__ == "__main__":
    main()
