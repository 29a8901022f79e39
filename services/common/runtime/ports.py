"""Free ports to hand to servers.

A port found free now (bind port 0, read it, close) is safe only if its server binds it again at once.
Every outgoing connection and every port-0 bind on the machine draws from the kernel's ephemeral
range, so a port from that range handed to a server that binds it later can be taken in between.
Seen in CI twice: vLLM's start-up opens dozens of connections (torch.distributed, ZMQ) and its NIXL
side-channel listener then failed to bind; and ``kvmesh up`` binds its HTTP port only after NATS, the
indexer, the router and the workers are up, by which time a worker's connection had taken it.

:func:`free_port` therefore draws from below the ephemeral range, where the kernel never hands out
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


class NoFreePortError(RuntimeError):
    """No port below the ephemeral range could be bound."""


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


def free_port(host: str = "127.0.0.1", rng: random.Random | None = None) -> int:
    """A port free now, below the ephemeral range, so that it stays free until its server binds it.

    Random rather than sequential, so two workers starting at once rarely pick the same one.
    Raises :class:`NoFreePortError` when the range below the ephemeral ports is too small or full.
    """
    return free_port_run(1, host, rng)


def free_port_run(count: int, host: str = "127.0.0.1", rng: random.Random | None = None) -> int:
    """The first of ``count`` consecutive ports free now, below the ephemeral range (as
    :func:`free_port`): for servers that bind a base port plus an offset each (vLLM's data-parallel
    ranks publish their KV events on the configured port plus their rank)."""
    rng = rng or random.SystemRandom()
    high = ephemeral_low() - count
    if high <= LOWEST_CANDIDATE:
        raise NoFreePortError(f"the ephemeral port range starts at {high + count}: no ports below it to choose from")
    for _ in range(ATTEMPTS):
        base = rng.randint(LOWEST_CANDIDATE, high)
        if all(is_free(base + offset, host) for offset in range(count)):
            return base
    what = "free port" if count == 1 else f"{count} consecutive free ports"
    raise NoFreePortError(f"no {what} between {LOWEST_CANDIDATE} and {high} after {ATTEMPTS} tries")


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


def process_tree(*roots: int) -> set[int]:
    """``roots`` and every process below them, as they are now (one pass over ``/proc``)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # it exited
            children.setdefault(parent, []).append(int(entry))
    found, unseen = set(), list(roots)
    while unseen:
        pid = unseen.pop()
        found.add(pid)
        unseen.extend(children.get(pid, ()))
    return found
