"""The proxies' tests' HTTP pieces: a stand-in server that answers each POST with
``answer(body)`` as JSON and records the bodies and their ``X-Request-Id`` headers ("" when
absent), in order; starting and stopping servers; posting a completion to one."""

from __future__ import annotations

import json
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable


def http_stand_in(answer: Callable[[dict[str, Any]], Any]
                  ) -> tuple[ThreadingHTTPServer, list[dict[str, Any]], list[str]]:
    """A started server on a free port: ``(server, bodies, request ids)``. An id is recorded
    before its body, so a body seen means its id is there too."""
    bodies: list[dict[str, Any]] = []
    ids: list[str] = []

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a: Any) -> None:
            pass

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            ids.append(self.headers.get("X-Request-Id", ""))
            bodies.append(body)
            data = json.dumps(answer(body)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return started(ThreadingHTTPServer(("127.0.0.1", 0), H)), bodies, ids


def started(srv: ThreadingHTTPServer) -> ThreadingHTTPServer:
    """``srv``, serving on a thread of its own."""
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def stop(*servers: ThreadingHTTPServer) -> None:
    for s in servers:
        s.shutdown()
        s.server_close()


def complete(srv: ThreadingHTTPServer, body: dict[str, Any], timeout: float) -> Any:
    """POST ``body`` to ``srv``'s ``/v1/completions``; its JSON answer."""
    req = urllib.request.Request(f"http://127.0.0.1:{srv.server_port}/v1/completions", method="POST",
                                 data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())
