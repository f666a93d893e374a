"""A prefill instance in its own process: vLLM's scheduler and a worker-side KVXConnector.

Driven over stdin/stdout with JSON lines by the tests (``PrefillProcess``):
``{"cmd": "prefill", "id": ..., "tokens": n}`` runs a request with do_remote_decode to its end
and answers its kv_transfer_params and block bytes; ``{"cmd": "step"}`` runs one engine step and
answers the free block count; ``{"cmd": "quit"}``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])

import vllm_utils as U


def main() -> None:
    extra = json.loads(sys.argv[1])
    eng = U.Engine(U.create_vllm_config("kv_producer", extra, engine_id="prefill-engine"), num_blocks=64, seed=1)
    print(json.dumps({"ready": True, "free": eng.free(), "initial": eng.initial_free}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        c = cmd["cmd"]
        if c == "prefill":
            req = U.create_request(cmd["id"], cmd["tokens"], max_tokens=1,
                                   kv_transfer_params={"do_remote_decode": True})
            eng.scheduler.add_request(req)
            eng.run_until(lambda: cmd["id"] in eng.outputs)
            params = eng.outputs[cmd["id"]].kv_transfer_params
            digests = [hashlib.sha256(U.block_bytes(eng.caches, b)).hexdigest() for b in params["remote_block_ids"][0]]
            print(json.dumps({"params": params, "digests": digests, "free": eng.free()}), flush=True)
        elif c == "push":
            # a push request (kv_transfer_params from kvx_vllm.proxy.push_params) run to its end;
            # "stall": [layer, seconds] sleeps after that layer's save_kv_layer, "die_after": layer
            # exits the process there (mid-stream)
            stall, die = cmd.get("stall"), cmd.get("die_after")

            def after_layer(name: str) -> None:
                i = int(name.split(".")[2])
                if stall and i == stall[0]:
                    time.sleep(float(stall[1]))
                if die is not None and i == die:
                    os._exit(3)

            eng.after_layer = after_layer
            req = U.create_request(cmd["id"], cmd["tokens"], max_tokens=1, kv_transfer_params=cmd["params"])
            eng.scheduler.add_request(req)
            eng.run_until(lambda: cmd["id"] in eng.outputs, max_steps=2000)
            eng.after_layer = None
            ids = eng.scheduler.kv_cache_manager.get_block_ids(cmd["id"])[0]
            digests = [hashlib.sha256(U.block_bytes(eng.caches, b)).hexdigest() for b in ids]
            print(json.dumps({"digests": digests, "free": eng.free(), "stats": eng.worker.worker.push_prefill.stats}),
                  flush=True)
        elif c == "step":
            for _ in range(int(cmd.get("n", 1))):
                eng.step()
                time.sleep(float(cmd.get("sleep", 0.0)))
            print(json.dumps({"free": eng.free(), "initial": eng.initial_free}), flush=True)
        elif c == "quit":
            eng.close()
            print(json.dumps({"bye": True}), flush=True)
            return


if __name__ == "__main__":
    main()
