"""Scheduler-side lifecycles with vLLM's real Scheduler, Request and block hasher.

The worker's part is played by hand-made KVConnectorOutputs, so every scheduler path
(delay-free, async load, load failure under both policies) is checked on its own; the
worker-side tests run the same flows with real transfers.
"""

from __future__ import annotations

import pytest
import vllm_utils as U
from kvx_vllm.metadata import KVXConnectorMetadata, KVXHandshakeMetadata
from vllm.v1.request import RequestStatus

PREFILL_PARAMS_KEYS = {"do_remote_prefill", "remote_block_ids", "remote_engine_id", "remote_request_id",
                       "remote_host", "remote_port", "remote_agents", "kvx_compat", "kvx_version"}


def _handshake() -> KVXHandshakeMetadata:
    layout = [[f"model.layers.{i}.self_attn.attn", 4096 * (i + 1), 16384, 16384, 64, 0] for i in range(U.NUM_LAYERS)]
    return KVXHandshakeMetadata(agent_name="kvx-vllm-p-tp0", host="127.0.0.1", port=5600, tp_rank=0, layout=layout,
                                compat={"pages": {}, "kind": 0, "dev": 0})


def _prefill(s, rid: str = "p1", n: int = 40) -> dict:
    req = U.create_request(rid, n, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    s.add_request(req)
    so = s.schedule()
    assert so.num_scheduled_tokens == {rid: n}
    out = s.update_from_output(so, U.model_runner_output([req]))
    (o,) = out[0].outputs
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    return o.kv_transfer_params


def test_remote_decode_lifecycle_holds_blocks_until_read() -> None:
    s = U.create_scheduler(U.create_vllm_config("kv_producer"))
    s.connector.set_xfer_handshake_metadata({0: _handshake()})
    initial = U.free_blocks(s)
    params = _prefill(s)
    assert PREFILL_PARAMS_KEYS <= set(params)
    assert params["remote_block_ids"] == [[1, 2, 3]]  # 40 tokens / 16 = 3 blocks
    assert params["remote_agents"]["0"][0] == "kvx-vllm-p-tp0"
    assert params["remote_host"] == "127.0.0.1" and params["remote_port"] == 5600
    # delay-free: the blocks stay allocated
    assert U.free_blocks(s) == initial - 3
    so = s.schedule()
    meta = so.kv_connector_metadata
    assert isinstance(meta, KVXConnectorMetadata)
    assert [x.req_id for x in meta.send] == ["p1"]
    assert "p1" in so.finished_req_ids
    s.update_from_output(so, U.model_runner_output([]))
    assert U.free_blocks(s) == initial - 3
    # the worker reports the read (or lease expiry): blocks are freed
    so = s.schedule()
    s.update_from_output(so, U.model_runner_output([], finished_sending={"p1"}))
    assert U.free_blocks(s) == initial
    assert "p1" not in s.requests


def test_aborted_prefill_frees_at_once() -> None:
    s = U.create_scheduler(U.create_vllm_config("kv_producer"))
    initial = U.free_blocks(s)
    req = U.create_request("p2", 40, max_tokens=4, kv_transfer_params={"do_remote_decode": True})
    s.add_request(req)
    s.schedule()
    s.finish_requests("p2", RequestStatus.FINISHED_ABORTED)
    assert U.free_blocks(s) == initial


def _decode_params() -> dict:
    p = U.create_scheduler(U.create_vllm_config("kv_producer"))
    p.connector.set_xfer_handshake_metadata({0: _handshake()})
    return _prefill(p)


def test_remote_prefill_lifecycle() -> None:
    params = _decode_params()
    s = U.create_scheduler(U.create_vllm_config("kv_consumer"))
    initial = U.free_blocks(s)
    req = U.create_request("d1", 40, max_tokens=3, kv_transfer_params=dict(params))
    s.add_request(req)
    so = s.schedule()
    assert so.num_scheduled_tokens == {}
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (recv,) = so.kv_connector_metadata.recv
    assert recv.req_id == "d1"
    assert len(recv.local_block_ids[0]) == 3 and recv.remote_block_ids == [[1, 2, 3]]
    assert recv.params["remote_request_id"] == "p1"
    s.update_from_output(so, U.model_runner_output([]))
    # not yet loaded: stays waiting
    so = s.schedule()
    assert so.num_scheduled_tokens == {}
    s.update_from_output(so, U.model_runner_output([], finished_recving={"d1"}))
    # loaded: only the last prompt token is computed
    so = s.schedule()
    assert so.num_scheduled_tokens == {"d1": 1}
    assert not so.kv_connector_metadata.recv  # no second pull
    s.update_from_output(so, U.model_runner_output([req]))
    for _ in range(2):
        so = s.schedule()
        s.update_from_output(so, U.model_runner_output([req]))
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    so = s.schedule()
    s.update_from_output(so, U.model_runner_output([]))
    assert U.free_blocks(s) == initial


def test_remote_prefill_aborted_before_scheduling_notifies_prefill() -> None:
    params = _decode_params()
    s = U.create_scheduler(U.create_vllm_config("kv_consumer"))
    initial = U.free_blocks(s)
    req = U.create_request("d2", 40, kv_transfer_params=dict(params))
    s.add_request(req)
    s.finish_requests("d2", RequestStatus.FINISHED_ABORTED)
    so = s.schedule()
    (recv,) = so.kv_connector_metadata.recv
    assert recv.req_id == "d2" and recv.local_block_ids == []
    assert U.free_blocks(s) == initial


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_load_failure_follows_policy(policy: str) -> None:
    params = _decode_params()
    s = U.create_scheduler(U.create_vllm_config("kv_consumer", failure_policy=policy))
    initial = U.free_blocks(s)
    req = U.create_request("d3", 40, max_tokens=2, kv_transfer_params=dict(params))
    s.add_request(req)
    so = s.schedule()
    (recv,) = so.kv_connector_metadata.recv
    bad = set(recv.local_block_ids[0])
    s.update_from_output(so, U.model_runner_output([]))
    so = s.schedule()
    out = s.update_from_output(so, U.model_runner_output([], finished_recving={"d3"}, invalid_block_ids=bad))
    if policy == "fail":
        outs = [o for e in out.values() for o in e.outputs if o.request_id == "d3"]
        assert outs and outs[0].finish_reason is not None
        assert req.status == RequestStatus.FINISHED_ERROR
    else:
        so = s.schedule()
        # recomputes the whole prompt locally
        assert so.num_scheduled_tokens == {"d3": 40}
        s.update_from_output(so, U.model_runner_output([req]))
        for _ in range(3):
            so = s.schedule()
            s.update_from_output(so, U.model_runner_output([req] if req.request_id in so.num_scheduled_tokens else []))
        assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    so = s.schedule()
    s.update_from_output(so, U.model_runner_output([]))
    assert U.free_blocks(s) == initial


def test_missing_kvx_params_computes_locally() -> None:
    s = U.create_scheduler(U.create_vllm_config("kv_consumer"))
    req = U.create_request("d4", 40, max_tokens=1, kv_transfer_params={"do_remote_prefill": True})
    s.add_request(req)
    so = s.schedule()
    assert so.num_scheduled_tokens == {"d4": 40}
