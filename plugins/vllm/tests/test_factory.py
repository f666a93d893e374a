"""vLLM's KVConnectorFactory builds KVXConnector from the operator's JSON config."""

from __future__ import annotations

import json

import kvx_vllm
import pytest
import vllm_utils as U
from kvx_vllm.connector import KVXConnector
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole, supports_hma

CLI_JSON = ('{"kv_connector": "KVXConnector", "kv_connector_module_path": "kvx_vllm", '
            '"kv_role": "kv_both", "kv_connector_extra_config": {"lease_s": 30}}')


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_factory_builds_connector_from_cli_json(role: KVConnectorRole) -> None:
    vc = U.create_vllm_config()
    vc.kv_transfer_config = KVTransferConfig(**json.loads(CLI_JSON))
    kcc = U.kv_cache_config(32)
    assert KVConnectorFactory.get_connector_class(vc.kv_transfer_config) is KVXConnector
    conn = KVConnectorFactory.create_connector(vc, role, kcc)
    try:
        assert isinstance(conn, KVXConnector) and isinstance(conn, KVConnectorBase_V1)
        assert conn.role == role
        assert conn.cfg.lease_s == 30
        assert (conn.scheduler is not None) == (role == KVConnectorRole.SCHEDULER)
        assert supports_hma(conn)
    finally:
        conn.shutdown()


def test_module_exports() -> None:
    assert kvx_vllm.KVXConnector is KVXConnector
    assert "KVXConnector" in kvx_vllm.__all__


def test_unknown_extra_key_is_refused() -> None:
    vc = U.create_vllm_config(extra={"leas_s": 3})
    with pytest.raises(ValueError, match="leas_s"):
        KVConnectorFactory.create_connector(vc, KVConnectorRole.SCHEDULER, U.kv_cache_config(8))


def test_scheduler_builds_connector() -> None:
    s = U.create_scheduler(U.create_vllm_config("kv_consumer"))
    assert isinstance(s.connector, KVXConnector)
