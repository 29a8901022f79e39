"""Child processes that end with their parent and keep out of the terminal's signals."""

from __future__ import annotations

import contextlib
import ctypes
import signal
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1

__all__ = ["die_with_parent"]


def _resolve_prctl() -> Callable[[int, int], int] | None:
    """libc's ``prctl``, looked up once in the parent (Linux; None elsewhere)."""
    with contextlib.suppress(OSError, AttributeError):
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    return None


# Resolved here, not in the child: between fork and exec only the forking thread exists, and a
# dlopen there can find the loader's or malloc's lock held by a thread that is gone (gRPC's threads,
# in the services and the tests). While the child looked libc up itself, the NATS outage test's
# restarted nats-server "exited" with SIGSEGV before it logged a line in 4 of 11 runs here (the
# child died before exec); resolved once in the parent, 0 of 10.
_PRCTL = _resolve_prctl()


def die_with_parent() -> None:
    """For ``preexec_fn``, in the child before exec: ask the kernel to SIGTERM the child when its
    parent dies (Linux; elsewhere a no-op). Pair it with ``start_new_session=True``: the child then
    neither outlives its parent nor receives the terminal's Ctrl-C, so the parent decides the order
    in which its children stop."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)
