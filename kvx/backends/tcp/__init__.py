"""``tcp``: host and CUDA memory between agents on any nodes, over TCP.

Design (see ``docs/networking.md``):

- **Listener.** Each agent listens on ``AgentConfig.listen`` (default ``127.0.0.1`` port 0,
  reachable from this machine only); its metadata section lists the addresses peers should
  dial. A wildcard bind (``0.0.0.0``/``::``) advertises the host's resolved addresses first
  and loopback last.
- **Connections.** A peer is reached through a small pool of streams (``STREAMS``, default
  2); a transfer is cut into chunks of about ``CHUNK`` bytes (many descriptors each) that the
  streams' sender threads take from one per-peer queue, pipelined without waiting for replies,
  so one large transfer keeps every stream busy.
- **Data path.** One frame per chunk: an 8-byte header, a msgpack body carrying the target's
  descriptors as raw uint64 bytes, then the payload. ``kvx._net`` sends it with ``sendmsg``
  over one iovec per (coalesced) registered descriptor and the target receives it with
  ``recvmsg`` straight into its registered memory: the kernel gathers and scatters, so a
  transfer costs the copies of a raw TCP stream. Reads are the mirror image.
- **Fast path.** Transfers of at most ``FAST_MAX`` bytes (16 descriptors) use one more,
  thread-less connection per peer: the posting thread sends request and payload, the thread
  that tests or waits reads the reply itself (short spin, then poll); the target validates such
  requests without numpy and spins briefly for the next one.
- **Target-side validation.** The target checks every descriptor of every request against its
  live registrations (``ctx.validate_local``) and re-checks and *pins* the regions under its
  own lock before it touches memory; ``deregister`` unpins-waits (bounded, then cuts the
  connections still holding the region), so a release racing a transfer fails cleanly with
  :class:`~kvx.errors.RemoteError` and nothing is written after release returns. A refused
  write's payload is drained into a scratch buffer, never into registered memory.
- **Authentication.** Every connection starts with the HMAC challenge of :mod:`kvx.auth`;
  before it completes, frames are limited to 64 KiB and the whole handshake must finish within
  ``handshake_timeout`` (slow-loris bound); at most ``MAX_HANDSHAKES`` run at once.
- **Failure bounds.** All socket I/O is nonblocking with ``poll``: no progress for
  ``peer_timeout`` seconds fails the peer; TCP keepalive and ``TCP_USER_TIMEOUT`` detect a dead
  or cut-off peer on idle connections; pending transfers turn FAILED with
  :class:`~kvx.errors.PeerDisconnected`.
- **Notifications** travel on the same streams, sent after every chunk of their transfer was
  acknowledged by the target, i.e. after the data landed.
- **CUDA memory** (:mod:`.staging`) crosses the socket through pinned slots of each connection:
  the sending side gathers a frame's blocks into a slot with the batched copy kernel (the next
  frame's gather running while one is on the wire), the receiving side lands the frame in a slot
  and scatters it while the connection goes on; a write is acknowledged after its scatter. The
  target validates and pins exactly as for host memory, per memory kind.
"""

from __future__ import annotations

from ...net import (
           MAX_HANDSHAKES,
           PREAUTH_MAX,
           client_handshake,
           open_listener,
           recv_frame,
           send_frame,
           server_handshake,
)
from .backend import TcpBackend, TcpOptions
from .common import CHUNK, ERRORS, FAST_MAX, STREAMS, _net, tune_socket

__all__ = ["CHUNK", "ERRORS", "FAST_MAX", "MAX_HANDSHAKES", "PREAUTH_MAX", "STREAMS", "TcpBackend", "TcpOptions",
           "_net", "client_handshake", "open_listener", "recv_frame", "send_frame", "server_handshake",
           "tune_socket"]
