"""The ``sglang.srt.plugins`` entry point installs the ``kvx`` PD backend without editing SGLang."""

from __future__ import annotations

import msgpack
import pytest

import kvx


def test_entry_point_adds_the_kvx_transfer_backend():
    from importlib.metadata import entry_points

    import sglang.srt.managers.disagg_service as disagg_service  # imported TransferBackend before the hook
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES
    from sglang.srt.plugins import load_plugins

    assert any(ep.value == "kvx_sglang.plugin:register" for ep in entry_points(group="sglang.srt.plugins"))
    load_plugins()
    from kvx_sglang import pd
    from sglang.srt.disaggregation import utils

    assert "kvx" in DISAGG_TRANSFER_BACKEND_CHOICES
    kvx_backend = utils.TransferBackend("kvx")
    assert disagg_service.TransferBackend is utils.TransferBackend  # every importer sees the new enum
    C = utils.KVClassType
    assert utils.get_kv_class(kvx_backend, C.MANAGER) is pd.KVXKVManager
    assert utils.get_kv_class(kvx_backend, C.SENDER) is pd.KVXKVSender
    assert utils.get_kv_class(kvx_backend, C.RECEIVER) is pd.KVXKVReceiver
    assert utils.get_kv_class(kvx_backend, C.BOOTSTRAP_SERVER) is pd.KVXKVBootstrapServer
    # SGLang's own backends are untouched
    assert utils.get_kv_class(utils.TransferBackend("fake"), C.MANAGER).__name__ == "FakeKVManager"
    assert [m.value for m in utils.TransferBackend][:5] == ["mooncake", "mori", "nixl", "ascend", "fake"]


PLACE = {"tp": 2, "rank": 1, "heads": 8, "page": 64, "mla": False}


def _layout(**kw):
    return msgpack.packb({"v": 2, "kv": [], "aux": [], "kind": 0, "dev": 0, **PLACE, **kw})


@pytest.mark.parametrize("payload,msg", [
    (b"\xc1", "malformed"),
    (_layout(v=1), "version"),
    (_layout(kv=[[1, 2]]), "rows"),
    (_layout(kv=[[4096, 8, 16]]), "empty buffer"),
    (_layout(kv=[[-1, 64, 16]]), "rows"),
    (_layout(kind=2), "memory kind"),
    (_layout(rank=2), "attention-TP place"),
    (_layout(tp=0, rank=0), "attention-TP place"),
    (_layout(page=0), "attention-TP place"),
    (_layout(heads=-1), "attention-TP place"),
    (_layout(heads=True), "attention-TP place"),
    (_layout(mla=1), "attention-TP place"),
    (msgpack.packb({"v": 2, "kv": [], "aux": [], "kind": 0, "dev": 0}), "attention-TP place"),
])
def test_a_malformed_peer_layout_is_a_protocol_error(payload, msg):
    from kvx_sglang.pd import _Layout

    with pytest.raises(kvx.ProtocolError, match=msg):
        _Layout.unpack(payload)


def test_a_layout_round_trips():
    from kvx_sglang.pd import _Layout

    lay = _Layout(((4096, 1 << 20, 4096),), ((8192, 4096, 64),), 0, 0, 4, 3, 8, 64, True)
    assert _Layout.unpack(lay.pack()) == lay
