"""Registration slots and the machine's boot id: constants the agent and the backends share.

Every live registered region holds one slot (an index into the control tables that same-node
backends publish); slot 0 is never used. Two agents are on the same node when their boot ids match.
"""

from __future__ import annotations

import socket

__all__ = ["BOOT_ID", "MAX_SLOTS"]

#: Most live regions one agent can hold (one slot each; published to same-node peers).
MAX_SLOTS = 1 << 16


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


#: This machine's boot id (the hostname where /proc does not tell it).
BOOT_ID = _boot_id()
