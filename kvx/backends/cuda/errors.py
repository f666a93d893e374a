"""The cuda backend's one error map: CUDA return codes and cupy's CUDA exceptions to the kvx tree.

Every CUDA failure the backend reports goes through :data:`ERRORS`, with ``where`` naming what was
attempted, and optionally the kvx class for that boundary (``(RegistrationError, "...")``;
default ``TransferError``): a driver call's return code as :class:`CudaError` (:func:`fail`),
cupy's ``CUDARuntimeError``/``CUDADriverError`` (matched without importing cupy), and the
``OSError`` of a libcuda that does not load.
"""

from __future__ import annotations

import abc
from typing import Any

from ...errors import KVXError, TransferError
from ..base import ErrorMap

__all__ = ["ERRORS", "CudaError", "fail"]


class CudaError(Exception):
    """A CUDA driver or runtime call returned ``code`` (a ``CUresult``/``cudaError_t``)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class _CupyCudaError(abc.ABC):  # noqa: B024 - an isinstance() check, nothing to implement
    """isinstance() of cupy's CUDA runtime/driver exceptions, without importing cupy."""

    @classmethod
    def __subclasshook__(cls, sub: type) -> bool:
        return any(k.__name__ in ("CUDARuntimeError", "CUDADriverError")
                   and k.__module__.split(".")[0] in ("cupy", "cupy_backends") for k in sub.__mro__)


def _split(where: Any) -> tuple[type[KVXError], str]:
    if isinstance(where, tuple):
        return where[0], str(where[1])
    return TransferError, str(where or "CUDA call")


def _code(exc: Any, where: Any) -> KVXError:
    cls, text = _split(where)
    return cls(f"{text} failed with CUDA error {exc.code}")


def _said(exc: Any, where: Any) -> KVXError:
    cls, text = _split(where)
    return cls(f"{text}: {exc}")


ERRORS = ErrorMap(
    (CudaError, None, _code),
    (_CupyCudaError, None, _said),
    (OSError, None, _said),
    default=_said,
)


def fail(code: int, where: Any) -> KVXError:
    """The kvx error for a CUDA call that returned ``code`` (``where`` as for :data:`ERRORS`), its
    cause a :class:`CudaError`; raise it."""
    cause = CudaError(code)
    err: KVXError = ERRORS(cause, where)
    err.__cause__ = cause
    return err
