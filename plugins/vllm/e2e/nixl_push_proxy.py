"""A proxy for vLLM's own push mode (``NixlPushConnector``, vLLM 0.32), used by ``bench_ttft.py``.

The protocol the connector expects (vllm ``distributed/kv_transfer/kv_connector/v1/nixl/``):

- Both legs carry the same ``X-Request-Id``. The completions server names a request
  ``cmpl-<X-Request-Id>-<n>`` and the engine adds ``-<8 hex>``; the prefill workers pair a decode
  registration with a finished prefill request by that name without the random suffix
  (``push_worker.py``, ``_pop_matching_registration`` / ``_pop_matching_finished_blocks`` with
  ``utils.get_base_request_id``), in whichever order the two arrive.
- The prefill leg: ``max_tokens=1`` and ``{"do_remote_decode": true}``, as in pull mode.
- The decode leg: ``{"do_remote_prefill": true}`` with the prefill's NIXL coordinates
  (``remote_engine_id``, ``remote_host``, ``remote_port``, ``tp_size``, ``pp_size``), known up
  front (the prefill server runs with a fixed ``engine_id`` and ``VLLM_NIXL_SIDE_CHANNEL_PORT``), and
  ``remote_request_id``, which ``NixlConnectorMetadata.add_new_req_to_recv`` needs (a KeyError in
  the decode engine without it) and the decode's lease heartbeats name. Its decode scheduler
  (``push_scheduler.py``, ``update_state_after_alloc``) allocates the request's blocks and its
  worker sends them to the prefill workers as a ``PUSH_REG`` NIXL notification; a prefill worker
  WRITEs the KV into them when the request has finished prefill and notifies the decode, which
  then computes.

Both legs are sent at once, so the decode allocates while the prefill computes; the decode's
answer is relayed (streamed or not), the prefill's is read and dropped.

    python nixl_push_proxy.py --port P --prefill http://h:p --decode http://h:d \\
        --prefill-engine-id prefill-0 --prefill-side-channel-port S [--prefill-kv-host 127.0.0.1]
"""

from __future__ import annotations

import argparse
import logging
import threading
import uuid
from typing import Any

from kvx_vllm.proxy import Proxy, serve_until_interrupted

log = logging.getLogger("nixl_push_proxy")


class NixlPushProxy(Proxy):
    """Sends each request to the prefill and the decode server at once (see the module docstring).

    Parameters
    ----------
    prefill, decode
        One base URL each (the prefill's NIXL coordinates are those of one server).
    engine_id, kv_host, side_channel_port, tp_size, pp_size
        The prefill server's NIXL coordinates: its ``kv_transfer_config`` ``engine_id``, its
        side-channel host and port, its TP and PP sizes.
    """

    def __init__(self, prefill: str, decode: str, engine_id: str, kv_host: str, side_channel_port: int,
                 tp_size: int = 1, pp_size: int = 1, timeout: float = 600.0) -> None:
        super().__init__([prefill], [decode], timeout, mode="pull")
        self.coords = {"remote_engine_id": engine_id, "remote_host": kv_host, "remote_port": side_channel_port,
                       "tp_size": tp_size, "pp_size": pp_size}

    def handle(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> Any:
        p, d = self.pick()
        rid = uuid.uuid4().hex
        h = {**headers, "X-Request-Id": rid}
        pbody = self.prefill_body(body)

        def prefill_leg() -> None:
            try:
                with self._post(p + path, pbody, h) as r:
                    r.read()
            except Exception as exc:  # the decode fails the request by its own bound
                log.warning("prefill leg %s to %s failed: %s", rid, p, exc)

        threading.Thread(target=prefill_leg, name="nixl-push-prefill", daemon=True).start()
        dbody = dict(body)
        dbody["kv_transfer_params"] = {"do_remote_prefill": True, "do_remote_decode": False, **self.coords,
                                       # the prefill's request as its completions server names it
                                       # (the engine's random suffix is not known here)
                                       "remote_request_id": f"cmpl-{rid}-0"}
        return self._post(d + path, dbody, h)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--prefill", required=True, help="the prefill server's URL")
    ap.add_argument("--decode", required=True, help="the decode server's URL")
    ap.add_argument("--prefill-engine-id", required=True, help="its kv_transfer_config engine_id")
    ap.add_argument("--prefill-kv-host", default="127.0.0.1", help="its VLLM_NIXL_SIDE_CHANNEL_HOST")
    ap.add_argument("--prefill-side-channel-port", type=int, required=True, help="its VLLM_NIXL_SIDE_CHANNEL_PORT")
    ap.add_argument("--prefill-tp-size", type=int, default=1)
    ap.add_argument("--prefill-pp-size", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=600.0)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO)
    proxy = NixlPushProxy(a.prefill, a.decode, a.prefill_engine_id, a.prefill_kv_host, a.prefill_side_channel_port,
                          a.prefill_tp_size, a.prefill_pp_size, a.timeout)
    serve_until_interrupted(proxy.serve(a.host, a.port))


if __name__ == "__main__":
    main()
