"""The proxy's two legs, against two small stand-in HTTP servers (no model needed)."""

from __future__ import annotations

import json
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvx_vllm.proxy import Proxy


def _server(answer: Any) -> tuple[ThreadingHTTPServer, list[dict[str, Any]]]:
    seen: list[dict[str, Any]] = []

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a: Any) -> None:
            pass

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body)
            data = json.dumps(answer(body)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, seen


def test_proxy_routes_prefill_then_decode() -> None:
    params = {"do_remote_prefill": True, "remote_block_ids": [[1, 2]], "remote_host": "127.0.0.1"}
    p, pseen = _server(lambda b: {"choices": [{"text": "x"}], "kv_transfer_params": params})
    d, dseen = _server(lambda b: {"choices": [{"text": "hello world"}]})
    proxy = Proxy([f"http://127.0.0.1:{p.server_port}"], [f"http://127.0.0.1:{d.server_port}"])
    srv = proxy.serve("127.0.0.1", 0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        req = urllib.request.Request(f"http://127.0.0.1:{srv.server_port}/v1/completions", method="POST",
                                     data=json.dumps({"model": "m", "prompt": "hi", "max_tokens": 20}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            out = json.loads(r.read())
        assert out["choices"][0]["text"] == "hello world"
        assert pseen[0]["max_tokens"] == 1 and pseen[0]["kv_transfer_params"]["do_remote_decode"] is True
        assert dseen[0]["max_tokens"] == 20 and dseen[0]["kv_transfer_params"] == params
    finally:
        for s in (srv, p, d):
            s.shutdown()
            s.server_close()
