"""SGLang plugin entry point (``sglang.srt.plugins``): adds the ``kvx`` PD transfer backend.

SGLang resolves ``--disaggregation-transfer-backend`` through a closed ``TransferBackend``
enum and ``get_kv_class``. Without editing SGLang, :func:`register` (run by SGLang's
``load_plugins()`` in every process, before arguments are parsed):

1. adds ``kvx`` to the CLI choices (``add_disagg_transfer_backend_choices``);
2. replaces ``TransferBackend`` with an enum of the same members plus ``KVX = "kvx"``
   (a class ``REPLACE`` hook; SGLang's hook registry rebinds every module that imported it);
3. wraps ``get_kv_class`` (an ``AROUND`` hook) to return the kvx manager, sender, receiver
   and bootstrap server for ``TransferBackend.KVX`` and defer to SGLang for the others.

The HiCache storage backend needs no plugin: it is loaded by ``--hicache-storage-backend
dynamic`` (see :mod:`kvx_sglang.hicache`).
"""

from __future__ import annotations

import enum
import logging
from typing import Any

log = logging.getLogger(__name__)

BACKEND = "kvx"


def extended_enum(original: type[enum.Enum]) -> type[enum.Enum]:
    """``original``'s members plus ``KVX``, under the same name and module."""
    if "KVX" in original.__members__:
        return original
    members = {m.name: m.value for m in original}
    members["KVX"] = BACKEND
    new = enum.Enum(original.__name__, members, module=original.__module__, qualname=original.__qualname__)  # type: ignore[misc]
    return new


def kv_class_hook(original_fn: Any, transfer_backend: Any, class_type: Any) -> Any:
    """``get_kv_class`` for ``TransferBackend.KVX``; SGLang's own answer for the others."""
    if getattr(transfer_backend, "value", transfer_backend) != BACKEND:
        return original_fn(transfer_backend, class_type)
    from sglang.srt.disaggregation.utils import KVClassType

    if class_type == KVClassType.KVARGS:
        return original_fn(transfer_backend, class_type)
    from . import pd

    return {
        KVClassType.MANAGER: pd.KVXKVManager,
        KVClassType.SENDER: pd.KVXKVSender,
        KVClassType.RECEIVER: pd.KVXKVReceiver,
        KVClassType.BOOTSTRAP_SERVER: pd.KVXKVBootstrapServer,
    }[class_type]


def register() -> None:
    """Install the ``kvx`` PD transfer backend into SGLang (idempotent)."""
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES, add_disagg_transfer_backend_choices
    from sglang.srt.disaggregation import utils
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND])
    HookRegistry.register("sglang.srt.disaggregation.utils.TransferBackend", extended_enum(utils.TransferBackend),
                          HookType.REPLACE)
    HookRegistry.register("sglang.srt.disaggregation.utils.get_kv_class", kv_class_hook, HookType.AROUND)
    log.debug("kvx PD transfer backend registered")
