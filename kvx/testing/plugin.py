"""pytest plugin of kvx (entry point ``pytest11``): markers and the ``--gpu`` switch.

Tests marked ``gpu`` are skipped unless a CUDA device is visible (``make gpu-check`` runs them
on a GPU machine).
"""

from __future__ import annotations

from typing import Any

import pytest


def pytest_configure(config: Any) -> None:
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU (make gpu-check)")
    config.addinivalue_line("markers", "services: needs real services started by the test session")
    config.addinivalue_line("markers", "netns: needs network namespaces (root)")


def _have_gpu() -> str | None:
    try:
        from kvx.backends.cuda import CudaBackend
    except ImportError as exc:
        return f"cuda backend not importable: {exc}"
    return CudaBackend.unavailable_reason()


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    reason = _have_gpu()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"no GPU: {reason}")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)
