"""Backend registry: string names -> Backend classes; third parties use the entry-point group
``kvx.backends``."""

from __future__ import annotations

import importlib
import logging
from importlib import metadata
from typing import TYPE_CHECKING

from ..errors import BackendUnavailable, UsageError

if TYPE_CHECKING:
    from .base import Backend

__all__ = ["BUILTIN", "OPT_IN", "register_backend", "get", "names", "ordered"]

log = logging.getLogger(__name__)

#: Built-in backends in default preference order: name -> "module:Class".
BUILTIN: dict[str, str] = {
    "cuda": "kvx.backends.cuda:CudaBackend",
    "host": "kvx.backends.host:HostBackend",
    "tcp": "kvx.backends.tcp:TcpBackend",
    "ucx": "kvx.backends.ucx:UcxBackend",  # optional: needs the libucx wheel (pip install kvx[ucx])
    "gds": "kvx.backends.gds:GdsBackend",
    "posix": "kvx.backends.posix:PosixBackend",
    "s3": "kvx.backends.s3:S3Backend",
}

#: Built-in backends that run only when named (``AgentConfig.backends`` / ``KVX_BACKENDS``): ucx
#: starts a UCX context, worker and threads per agent and reaches peers by UCX's own transport
#: selection, so agents that did not ask for it do not pay for it.
OPT_IN: frozenset[str] = frozenset({"ucx"})

_extra: dict[str, "type[Backend] | str"] = {}
_loaded_eps = False


def register_backend(name: str, cls: "type[Backend] | str") -> None:
    """Register a backend class (or ``"module:Class"`` path) under ``name``."""
    if not name or not isinstance(name, str):
        raise UsageError("backend name must be a non-empty string")
    _extra[name] = cls


def _load_entry_points() -> None:
    global _loaded_eps
    if _loaded_eps:
        return
    _loaded_eps = True
    try:
        eps = metadata.entry_points(group="kvx.backends")
    except Exception:  # pragma: no cover - broken environments
        log.debug("cannot read entry points", exc_info=True)
        return
    for ep in eps:
        if ep.name not in BUILTIN and ep.name not in _extra:
            _extra[ep.name] = ep.value


def names() -> list[str]:
    """All known backend names, built-in first."""
    _load_entry_points()
    return list(BUILTIN) + [n for n in _extra if n not in BUILTIN]


def _resolve(spec: "type[Backend] | str") -> "type[Backend]":
    if not isinstance(spec, str):
        return spec
    mod, _, attr = spec.partition(":")
    return getattr(importlib.import_module(mod), attr)  # type: ignore[no-any-return]


def get(name: str) -> "type[Backend]":
    """The Backend class called ``name``."""
    _load_entry_points()
    spec = _extra.get(name) or BUILTIN.get(name)
    if spec is None:
        raise BackendUnavailable(f"unknown backend {name!r}; known: {', '.join(names())}")
    try:
        return _resolve(spec)
    except ImportError as exc:
        raise BackendUnavailable(f"backend {name!r} cannot be imported: {exc}") from exc


def ordered(prefer: tuple[str, ...] | list[str] = ()) -> list[tuple[str, "type[Backend]"]]:
    """Backend classes in preference order (``prefer`` only, if given)."""
    out = []
    for n in (list(prefer) if prefer else [n for n in names() if n not in OPT_IN]):
        try:
            out.append((n, get(n)))
        except BackendUnavailable:
            if prefer:
                raise
            log.debug("backend %s not importable", n, exc_info=True)
    return out
