"""Transfer handles returned by ``Agent.read`` / ``Agent.write``."""

from __future__ import annotations

import asyncio
import enum
import time
from typing import TYPE_CHECKING, Any, Callable, Generator

from . import _args
from .backends.base import DoneRequest
from .errors import KVXError, TransferError, TransferTimeout

if TYPE_CHECKING:
    from .backends.base import Request

__all__ = ["Status", "Transfer", "TransferPlan"]


class Status(enum.Enum):
    """State of a transfer."""

    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


_new = object.__new__


class Transfer:
    """A posted transfer. Poll with :attr:`status` or :meth:`done`, block with :meth:`wait`,
    or ``await`` it.

    Every transfer has a deadline (``AgentConfig.transfer_timeout``); past it the transfer is
    cancelled and turns FAILED with :class:`~kvx.errors.TransferTimeout`.
    """

    __slots__ = ("_deadline", "_error", "_on_end", "_req", "_status", "backend", "nbytes")

    def __init__(
        self,
        req: "Request",
        nbytes: int,
        backend: str,
        timeout: float,
        on_end: Callable[["Transfer"], None] | None = None,
    ) -> None:
        self._req: Request | None = req
        self._status = Status.PENDING
        self._error: BaseException | None = None
        self.nbytes = nbytes
        self.backend = backend
        self._deadline = time.monotonic() + timeout
        self._on_end = on_end
        self._poll()

    @classmethod
    def _completed(cls, nbytes: int, backend: str) -> "Transfer":
        """A transfer that finished while it was posted (the small-transfer fast path)."""
        t = _new(cls)
        t._req = None
        t._status = _DONE
        t._error = None
        t.nbytes = nbytes
        t.backend = backend
        t._on_end = None
        return t

    def _end(self, status: Status, err: BaseException | None) -> None:
        self._status = status
        self._error = err
        self._req = None
        cb, self._on_end = self._on_end, None
        if cb is not None:
            cb(self)

    def _poll(self) -> None:
        req = self._req
        if req is None:
            return
        try:
            finished = req.test()
        except TransferError as exc:
            self._end(Status.FAILED, exc)
            return
        except KVXError as exc:  # a backend's non-transfer error: say which, keep it as the cause
            err = TransferError(f"{type(exc).__name__}: {exc}")
            err.__cause__ = exc
            self._end(Status.FAILED, err)
            return
        if finished:
            self._end(Status.DONE, None)
        elif time.monotonic() > self._deadline:
            req.cancel()
            self._end(Status.FAILED, TransferTimeout(f"transfer of {self.nbytes} bytes did not finish in time"))

    @property
    def status(self) -> Status:
        """Current state (polls the backend)."""
        if self._status is Status.PENDING:
            self._poll()
        return self._status

    @property
    def error(self) -> BaseException | None:
        """The exception that failed the transfer, or None."""
        if self._status is Status.PENDING:
            self._poll()
        return self._error

    def done(self) -> bool:
        """True once the transfer is no longer pending (DONE, FAILED or CANCELLED)."""
        return self.status is not Status.PENDING

    def wait(self, timeout: float | None = None) -> "Transfer":
        """Block until the transfer ends; raise its error if it failed.

        Parameters
        ----------
        timeout
            Seconds to wait at most, from 0 to 1e7 (default: until the transfer's own deadline).
            A transfer already DONE returns at once without looking at it, as
            ``concurrent.futures.Future.result`` does; any other checks it first.

        Raises
        ------
        ArgumentTypeError, ArgumentValueError
            (both ``kvx.UsageError``) if ``timeout`` is not a number of seconds in that range.
        TransferTimeout
            If it is still pending after ``timeout`` (the transfer keeps going).
        TransferError
            If it failed or was cancelled.
        """
        if self._status is _DONE:  # no check on the latency path: as Future.result(timeout) does
            return self
        return self._wait(timeout)

    def _wait(self, timeout: float | None) -> "Transfer":
        if timeout is not None:
            timeout = _args.seconds(timeout, "wait timeout")
        if self._status is Status.PENDING:
            now = time.monotonic()
            limit = self._deadline - now if timeout is None else min(timeout, max(0.0, self._deadline - now))
            req = self._req
            if req is not None:
                try:
                    req.wait(max(0.0, limit))
                except TransferError:
                    pass
            self._poll()
            if self._status is Status.PENDING:
                if timeout is not None and timeout < self._deadline - now:
                    raise TransferTimeout(f"transfer still pending after {timeout} s")
                self._poll()
        if self._status is Status.FAILED:
            assert self._error is not None
            raise self._error
        if self._status is Status.CANCELLED:
            raise TransferError("transfer was cancelled")
        return self

    def cancel(self) -> bool:
        """Cancel if still pending. Returns True if it ends CANCELLED."""
        if self.status is not Status.PENDING:
            return False
        req = self._req
        assert req is not None
        if req.cancel():
            self._end(Status.CANCELLED, None)
            return True
        return False

    def __await__(self) -> Generator[Any, None, "Transfer"]:
        delay = 5e-5
        while self.status is Status.PENDING:
            yield from asyncio.sleep(delay).__await__()
            delay = min(delay * 2, 2e-3)
        return self.wait(0)

    def __repr__(self) -> str:
        return f"<Transfer {self.status.name} {self.nbytes} bytes via {self.backend}>"


_DONE = Status.DONE


class TransferPlan:
    """A transfer prepared once and posted many times (``Agent.make_transfer``).

    Posting a plan skips index conversion, descriptor gathering and backend selection: for
    small transfers this is the lowest-latency way to move bytes.
    """

    __slots__ = ("_agent", "_backend", "_lists", "_post", "nbytes")

    def __init__(self, agent: Any, post: Callable[[], Any], backend: str, lists: tuple[Any, Any], nbytes: int) -> None:
        self._agent = agent
        self._post = post
        self._backend = backend
        self._lists = lists
        self.nbytes = nbytes

    def post(self) -> Transfer:
        """Start the transfer again; returns a new :class:`Transfer`."""
        self._agent._check_post(*self._lists)
        req = self._post()
        if type(req) is DoneRequest:
            return Transfer._completed(req.nbytes, self._backend)
        return Transfer(req, req.nbytes, self._backend, self._agent.config.transfer_timeout)

    def __repr__(self) -> str:
        return f"<TransferPlan {self.nbytes} bytes via {self._backend}>"
