"""The proxy's two legs, against two small stand-in HTTP servers (no model needed)."""

from __future__ import annotations

import threading
from typing import Any

from kvx_vllm.proxy import Proxy
from stand_in import complete, http_stand_in, started, stop


def test_proxy_routes_prefill_then_decode() -> None:
    params = {"do_remote_prefill": True, "remote_block_ids": [[1, 2]], "remote_host": "127.0.0.1"}
    p, pseen, _ = http_stand_in(lambda b: {"choices": [{"text": "x"}], "kv_transfer_params": params})
    d, dseen, _ = http_stand_in(lambda b: {"choices": [{"text": "hello world"}]})
    proxy = Proxy([f"http://127.0.0.1:{p.server_port}"], [f"http://127.0.0.1:{d.server_port}"])
    srv = started(proxy.serve("127.0.0.1", 0))
    try:
        out = complete(srv, {"model": "m", "prompt": "hi", "max_tokens": 20}, 10)
        assert out["choices"][0]["text"] == "hello world"
        assert pseen[0]["max_tokens"] == 1 and pseen[0]["kv_transfer_params"]["do_remote_decode"] is True
        assert dseen[0]["max_tokens"] == 20 and dseen[0]["kv_transfer_params"] == params
    finally:
        stop(srv, p, d)


def test_proxy_push_mode_learns_the_endpoint_then_sends_both_at_once() -> None:
    from kvx_vllm.proxy import ENDPOINT_KEYS

    endpoint = {k: f"v-{k}" for k in ENDPOINT_KEYS}
    params = {**endpoint, "do_remote_prefill": True, "remote_block_ids": [[1, 2]], "remote_request_id": "r0"}
    decode_got = threading.Event()

    def prefill_answer(b: dict[str, Any]) -> Any:
        if b["kv_transfer_params"].get("kvx_push"):
            # the decode leg was sent without waiting for this answer
            assert decode_got.wait(10), "push mode waited for the prefill before sending to decode"
        return {"choices": [{"text": "x"}], "kv_transfer_params": params}

    def decode_answer(b: dict[str, Any]) -> Any:
        decode_got.set()
        return {"choices": [{"text": "out"}]}

    p, pseen, _ = http_stand_in(prefill_answer)
    d, dseen, _ = http_stand_in(decode_answer)
    proxy = Proxy([f"http://127.0.0.1:{p.server_port}"], [f"http://127.0.0.1:{d.server_port}"], mode="push")
    srv = started(proxy.serve("127.0.0.1", 0))
    try:
        for _ in range(2):
            decode_got.clear()
            assert complete(srv, {"model": "m", "prompt": "hi", "max_tokens": 5}, 20)["choices"][0]["text"] == "out"
        # first request: pull (the endpoint is learned from its answer)
        assert "kvx_push" not in pseen[0]["kv_transfer_params"] and dseen[0]["kv_transfer_params"] == params
        # second: push, one fresh id on both legs, the decode told the endpoint and no blocks
        import time

        end = time.monotonic() + 10
        while len(pseen) < 2 and time.monotonic() < end:
            time.sleep(0.01)
        pid = pseen[1]["kv_transfer_params"]["kvx_push"]
        dp = dseen[1]["kv_transfer_params"]
        assert pid and dp["kvx_push"] == pid and dp["remote_request_id"] == pid and dp["remote_block_ids"] == []
        assert pseen[1]["kv_transfer_params"]["do_remote_decode"] is True and pseen[1]["max_tokens"] == 1
        assert all(dp[k] == endpoint[k] for k in ENDPOINT_KEYS) and dp["do_remote_prefill"] is True
    finally:
        stop(srv, p, d)


def test_push_config_and_params_are_checked() -> None:
    import pytest
    from kvx_vllm.config import KVXConnectorConfig
    from kvx_vllm.proxy import push_params

    cfg = KVXConnectorConfig.from_extra({"transfer_mode": "push", "layerwise": "true", "push_group": "2"})
    assert cfg.push and cfg.layerwise and cfg.push_group == 2
    assert not KVXConnectorConfig.from_extra({}).push
    with pytest.raises(ValueError, match="transfer_mode"):
        KVXConnectorConfig.from_extra({"transfer_mode": "pushy"})
    with pytest.raises(ValueError, match="layerwise needs"):
        KVXConnectorConfig.from_extra({"layerwise": True})
    with pytest.raises(ValueError):
        KVXConnectorConfig.from_extra({"transfer_mode": "push", "push_timeout_s": 0})
    with pytest.raises(ValueError, match="missing"):
        push_params({"remote_host": "h"})
    with pytest.raises(ValueError):
        Proxy(["http://p"], ["http://d"], mode="both")


def test_push_hello_is_validated() -> None:
    import pytest
    from kvx_vllm.push import hello_note, is_push_message, parse_hello

    import kvx

    h = parse_hello(hello_note(b"meta", [["l0", 1, 2]], int(kvx.MemoryKind.HOST), 0))
    assert h is not None and h.meta == b"meta" and h.layout == [["l0", 1, 2]]
    assert is_push_message(hello_note(b"", [1], 1, 0))
    assert parse_hello(b"req-1\n1") is None and not is_push_message(b"req-1\n1")
    for bad in (b"kvx-push-hello\x00garbage", hello_note(b"m", [], 1, 0), hello_note(b"m", [1], 99, 0),
                hello_note(b"m", [1], 1, -1)):
        with pytest.raises(kvx.ProtocolError):
            parse_hello(bad)
