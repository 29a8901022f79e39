"""Child processes that end with their parent and keep out of the terminal's signals."""

from __future__ import annotations

import contextlib
import ctypes
import signal

_PR_SET_PDEATHSIG = 1

__all__ = ["die_with_parent"]


def die_with_parent() -> None:
    """For ``preexec_fn``, in the child before exec: ask the kernel to SIGTERM the child when its
    parent dies (Linux; elsewhere a no-op). Pair it with ``start_new_session=True``: the child then
    neither outlives its parent nor receives the terminal's Ctrl-C, so the parent decides the order
    in which its children stop."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
