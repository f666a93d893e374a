"""``e2e/nixl_push_proxy.py`` (the bench's proxy for vLLM's NixlPushConnector) against two
stand-in HTTP servers: both legs at once, under one ``X-Request-Id``, with the kv_transfer_params
NixlPushConnector reads on each side."""

from __future__ import annotations

import threading
from typing import Any

from nixl_push_proxy import NixlPushProxy
from stand_in import complete, http_stand_in, started, stop


def test_both_legs_at_once_under_one_request_id() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import get_base_request_id

    decode_got = threading.Event()

    def prefill_answer(b: dict[str, Any]) -> Any:
        assert decode_got.wait(10), "the proxy waited for the prefill before sending to decode"
        return {"choices": [{"text": "x"}], "kv_transfer_params": {"do_remote_prefill": True}}

    def decode_answer(b: dict[str, Any]) -> Any:
        decode_got.set()
        return {"choices": [{"text": "out"}]}

    p, pseen, pids = http_stand_in(prefill_answer)
    d, dseen, dids = http_stand_in(decode_answer)
    proxy = NixlPushProxy(f"http://127.0.0.1:{p.server_port}", f"http://127.0.0.1:{d.server_port}",
                          engine_id="prefill-0", kv_host="127.0.0.1", side_channel_port=5600, tp_size=2)
    srv = started(proxy.serve("127.0.0.1", 0))
    try:
        for _ in range(2):
            decode_got.clear()
            assert complete(srv, {"model": "m", "prompt": [1, 2], "max_tokens": 9}, 10)["choices"][0]["text"] == "out"
        for _ in range(100):  # the prefill leg's thread may still be writing its log
            if len(pseen) == 2:
                break
            threading.Event().wait(0.05)
        assert len(pseen) == 2 and len(dseen) == 2
        ids = set()
        for pb, pid, db, did in zip(pseen, pids, dseen, dids):
            assert pid == did and pid, (pid, did)  # one X-Request-Id for both legs
            ids.add(pid)
            assert pb["max_tokens"] == 1 and pb["kv_transfer_params"] == {"do_remote_decode": True,
                                                                         "do_remote_prefill": False}
            kp = db["kv_transfer_params"]
            assert db["max_tokens"] == 9
            assert kp == {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "prefill-0",
                          "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 2, "pp_size": 1,
                          "remote_request_id": f"cmpl-{pid}-0"}
            # the completions server names the request cmpl-<X-Request-Id>-0, the engine adds
            # -<8 hex>: the prefill workers pair the legs by the name without that suffix
            assert get_base_request_id(f"cmpl-{pid}-0-0badcafe") == get_base_request_id(f"cmpl-{pid}-0-12345678")
        assert len(ids) == 2  # a fresh id per request
    finally:
        stop(srv, p, d)
