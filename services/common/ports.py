"""Free ports to hand to servers.

:func:`free_port` (bind port 0, read it, close) is safe only when the server binds it again at once.
A port handed to an engine that binds it a minute later, after loading its model, can be taken in
between: every outgoing connection and every port-0 bind on the machine draws from the kernel's
ephemeral range, and vLLM's start-up alone opens dozens (torch.distributed, ZMQ). vLLM's NIXL
side-channel listener then fails to bind in a background thread and the engine waits for it forever
(seen in CI: ``Address already in use`` and a worker that never came up).

:func:`late_bound_port` draws from below the ephemeral range instead, where the kernel never hands out
ports on its own; only an explicit bind by some other program can take it.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Linux's default ephemeral range, where the file cannot be read (other systems, sandboxes).
DEFAULT_EPHEMERAL_LOW = 32768
# Below this are well-known and commonly registered ports (databases, web servers, NATS' 4222).
LOWEST_CANDIDATE = 10000
ATTEMPTS = 200


def free_port(host: str = "127.0.0.1") -> int:
    """A port the kernel reports free now, from its ephemeral range: for a server that binds it at once."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class NoFreePortError(RuntimeError):
    """No port outside the ephemeral range could be bound."""


def ephemeral_low() -> int:
    """The lowest port the kernel hands out for port-0 binds and outgoing connections."""
    try:
        return int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return DEFAULT_EPHEMERAL_LOW


def is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def late_bound_port(host: str = "127.0.0.1", rng: random.Random | None = None) -> int:
    """A port free now, below the ephemeral range, for a server that binds it later.

    Random rather than sequential, so two workers starting at once rarely pick the same one.
    Raises :class:`NoFreePortError` when the range below the ephemeral ports is too small or full.
    """
    rng = rng or random.SystemRandom()
    high = ephemeral_low() - 1
    if high <= LOWEST_CANDIDATE:
        raise NoFreePortError(f"the ephemeral port range starts at {high + 1}: no ports below it to choose from")
    for _ in range(ATTEMPTS):
        port = rng.randint(LOWEST_CANDIDATE, high)
        if is_free(port, host):
            return port
    raise NoFreePortError(f"no free port between {LOWEST_CANDIDATE} and {high} after {ATTEMPTS} tries")


def pid_listening_on(port: int) -> int:
    """The process with a listening TCP socket on ``port`` (read from /proc; no tools needed)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # 0A: LISTEN
                    inodes.add(fields[9])
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (entry / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    return int(entry.name)
    raise LookupError(f"no process listens on port {port}")
