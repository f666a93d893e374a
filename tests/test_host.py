"""The host backend through the conformance suite, once per same-node path."""

from __future__ import annotations

from kvx.testing.conformance import TransferConformance


class TestHostShm(TransferConformance):
    backend = "host"
    config = {"host_path": "auto"}
    mem = "alloc"


class TestHostCma(TransferConformance):
    backend = "host"
    config = {"host_path": "cma"}
    mem = "numpy"


class TestHostUds(TransferConformance):
    backend = "host"
    config = {"host_path": "uds"}
    mem = "numpy"
