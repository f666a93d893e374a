"""A small prefill/decode proxy for 1P1D and xPyD deployments (stdlib only).

Each completion request goes first to a prefill server with ``max_tokens=1`` and
``kv_transfer_params={"do_remote_decode": true}``; the ``kv_transfer_params`` it answers with
(which blocks, which kvx agent, how to reach it) go with the original request to a decode
server, whose answer (streamed or not) is relayed to the client. Servers are picked round robin.

With ``--mode push`` (both servers run the connector with ``"transfer_mode": "push"``) the
request goes to the prefill and the decode server at once, tied by a fresh push id: the decode
server allocates its blocks and registers them with the prefill workers, which write the KV into
them. The proxy learns each prefill server's kvx endpoint (its workers, not a request's blocks)
from the first answer it gets from it, so a prefill server's first request goes by pull.

Run::

    python -m kvx_vllm.proxy --port 8000 --prefill http://p0:8100 --decode http://d0:8200 [--decode ...]
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import threading
import urllib.error
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["ENDPOINT_KEYS", "Proxy", "main", "push_params", "serve_until_interrupted"]

log = logging.getLogger(__name__)

ROUTES = ("/v1/completions", "/v1/chat/completions")

#: kv_transfer_params keys that describe a prefill instance (not one request): what a decode
#: instance needs to reach its workers in push mode
ENDPOINT_KEYS = ("remote_engine_id", "remote_host", "remote_port", "remote_agents", "tp_size", "kvx_version",
                 "kvx_compat", "kvx_lease_s")


def push_params(endpoint: dict[str, Any], push_id: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The kv_transfer_params of one push request: ``(for the prefill, for the decode server)``.

    ``endpoint``: a prefill server's kv_transfer_params from any earlier answer (only
    :data:`ENDPOINT_KEYS` are used); ``push_id``: fresh per request (default: a random one).
    """
    missing = [k for k in ENDPOINT_KEYS if k not in endpoint]
    if missing:
        raise ValueError(f"not a kvx prefill endpoint (missing {missing})")
    push_id = push_id or uuid.uuid4().hex
    pre = {"do_remote_decode": True, "do_remote_prefill": False, "kvx_push": push_id}
    dec = {k: endpoint[k] for k in ENDPOINT_KEYS}
    dec.update(do_remote_prefill=True, do_remote_decode=False, kvx_push=push_id, remote_request_id=push_id,
               remote_block_ids=[], kvx_lease=0)
    return pre, dec


class Proxy:
    """Routes completions through a prefill server, then a decode server.

    Parameters
    ----------
    prefill, decode
        Base URLs (``http://host:port``) of the vLLM servers.
    timeout
        Seconds to wait for a server's answer.
    mode
        ``"pull"`` or ``"push"`` (see the module docstring).
    """

    def __init__(self, prefill: list[str], decode: list[str], timeout: float = 600.0, mode: str = "pull") -> None:
        if not prefill or not decode:
            raise ValueError("the proxy needs at least one prefill and one decode server")
        if mode not in ("pull", "push"):
            raise ValueError(f"mode must be 'pull' or 'push', not {mode!r}")
        self.mode = mode
        self._endpoints: dict[str, dict[str, Any]] = {}  # prefill URL -> its kvx endpoint
        self.prefill = [u.rstrip("/") for u in prefill]
        self.decode = [u.rstrip("/") for u in decode]
        self.timeout = timeout
        self._p = itertools.cycle(self.prefill)
        self._d = itertools.cycle(self.decode)
        self._lock = threading.Lock()

    def pick(self) -> tuple[str, str]:
        with self._lock:
            return next(self._p), next(self._d)

    @staticmethod
    def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
        """The request the prefill server gets: one token, no streaming, hand the KV off."""
        p = dict(body)
        p["max_tokens"] = 1
        if "max_completion_tokens" in p:
            p["max_completion_tokens"] = 1
        p["stream"] = False
        p.pop("stream_options", None)
        p["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
        return p

    def _post(self, url: str, body: dict[str, Any], headers: dict[str, str]) -> Any:
        req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={**headers, "Content-Type": "application/json"})
        return urllib.request.urlopen(req, timeout=self.timeout)

    def handle(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> Any:
        """Run the two legs; returns the decode server's open response."""
        p, d = self.pick()
        endpoint = self._endpoints.get(p) if self.mode == "push" else None
        if endpoint is not None:
            return self._push(p, d, path, body, headers, endpoint)
        with self._post(p + path, self.prefill_body(body), headers) as r:
            first = json.loads(r.read())
        params = first.get("kv_transfer_params")
        if not params:
            raise RuntimeError(f"prefill server {p} returned no kv_transfer_params (is it run with "
                               "kv_role kv_producer and the KVXConnector?)")
        if self.mode == "push" and all(k in params for k in ENDPOINT_KEYS):
            self._endpoints[p] = {k: params[k] for k in ENDPOINT_KEYS}
        dbody = dict(body)
        dbody["kv_transfer_params"] = params
        log.debug("request routed %s -> %s", p, d)
        return self._post(d + path, dbody, headers)

    def _push(self, p: str, d: str, path: str, body: dict[str, Any], headers: dict[str, str],
              endpoint: dict[str, Any]) -> Any:
        """Both legs at once; the prefill leg's answer is only checked (the decode server fails
        the request by its push bound if the prefill never writes)."""
        pre, dec = push_params(endpoint)
        pbody = self.prefill_body(body)
        pbody["kv_transfer_params"] = pre

        def prefill_leg() -> None:
            try:
                with self._post(p + path, pbody, headers) as r:
                    params = json.loads(r.read()).get("kv_transfer_params") or {}
                if all(k in params for k in ENDPOINT_KEYS):  # a restarted server's new endpoint
                    self._endpoints[p] = {k: params[k] for k in ENDPOINT_KEYS}
            except Exception as exc:
                log.warning("proxy: prefill leg of push %s to %s failed: %s", pre["kvx_push"], p, exc)
                self._endpoints.pop(p, None)  # learn it again from the next answer

        threading.Thread(target=prefill_leg, name="kvx-proxy-prefill", daemon=True).start()
        dbody = dict(body)
        dbody["kv_transfer_params"] = dec
        return self._post(d + path, dbody, headers)

    def serve(self, host: str, port: int) -> ThreadingHTTPServer:
        """An HTTP server (not started: call ``serve_forever``)."""
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, fmt: str, *args: Any) -> None:
                log.debug(fmt, *args)

            def _reply(self, code: int, obj: Any) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path in ("/health", "/healthz"):
                    self._reply(200, {"prefill": proxy.prefill, "decode": proxy.decode})
                else:
                    self._reply(404, {"error": "not found"})

            def do_POST(self) -> None:
                if self.path not in ROUTES:
                    self._reply(404, {"error": f"only {', '.join(ROUTES)}"})
                    return
                try:
                    n = int(self.headers.get("Content-Length", "0"))
                    body = json.loads(self.rfile.read(n) or b"{}")
                    fwd = {k: v for k, v in self.headers.items() if k.lower() in ("authorization", "x-request-id")}
                    resp = proxy.handle(self.path, body, fwd)
                except urllib.error.HTTPError as exc:
                    self._reply(exc.code, {"error": exc.read().decode(errors="replace")})
                    return
                except Exception as exc:
                    log.warning("proxy: %s", exc)
                    self._reply(502, {"error": str(exc)})
                    return
                with resp:
                    self.send_response(resp.status)
                    self.send_header("Content-Type", resp.headers.get("Content-Type", "application/json"))
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    while True:
                        chunk = resp.read1(65536) if hasattr(resp, "read1") else resp.read(65536)
                        if not chunk:
                            break
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")

        return ThreadingHTTPServer((host, port), Handler)


def serve_until_interrupted(srv: ThreadingHTTPServer) -> None:
    """Run a proxy's server (from :meth:`Proxy.serve`) until Ctrl-C, then close its listener."""
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        srv.server_close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kvx_vllm.proxy", description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--prefill", action="append", required=True, help="prefill server URL (repeatable)")
    ap.add_argument("--decode", action="append", required=True, help="decode server URL (repeatable)")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--mode", choices=("pull", "push"), default="pull",
                    help="push: prefill and decode at once (servers run with transfer_mode push)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    srv = Proxy(a.prefill, a.decode, a.timeout, a.mode).serve(a.host, a.port)
    log.info("kvx_vllm proxy on %s:%d: prefill %s, decode %s", a.host, a.port, a.prefill, a.decode)
    serve_until_interrupted(srv)


if __name__ == "__main__":
    main()
