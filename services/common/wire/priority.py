"""The router queue's priority classes: declared here once, validated here once.

A request names its class in ``RoutingHints.priority`` (gRPC), the ``x-kvmesh-priority`` header or
the body's ``kvmesh.priority`` (HTTP); while every worker is busy it waits in its class's queue, and
a class gets queue turns in proportion to its share (``--router-queue-shares``). Tools draw classes
for generated load from a mix of shares (``--priority-mix``).
"""

from __future__ import annotations

from enum import StrEnum


class Priority(StrEnum):
    HIGH = "high"
    NORMAL = "normal"
    LOW = "low"


DEFAULT_PRIORITY = Priority.NORMAL
PRIORITY_HEADER = "x-kvmesh-priority"
CLASSES = ", ".join(Priority)


def parse_priority(text: str) -> Priority:
    """A request's class from its wire form (empty: the default); ValueError names the classes."""
    if not text:
        return DEFAULT_PRIORITY
    try:
        return Priority(text)
    except ValueError:
        raise ValueError(f"unknown priority {text!r}; use one of {CLASSES}") from None


def parse_shares(text: str) -> dict[Priority, float]:
    """``high=6,normal=3,low=1``: a positive share for every class (how queue turns are divided)."""
    shares = _class_shares(text)
    if any(v <= 0 for v in shares.values()):
        raise ValueError(f"{text!r}: each class once, with a share above 0")
    missing = [str(p) for p in Priority if p not in shares]
    if missing:
        raise ValueError(f"no share for {', '.join(sorted(missing))}")
    return shares


def parse_mix(text: str) -> dict[Priority, float]:
    """``high=0.2,normal=0.5,low=0.3``: the share of requests in each class named (summing to 1)."""
    shares = _class_shares(text)
    if any(v < 0 for v in shares.values()) or abs(sum(shares.values()) - 1.0) > 1e-6:
        raise ValueError("the shares must be >= 0 and sum to 1")
    return shares


def _class_shares(text: str) -> dict[Priority, float]:
    shares: dict[Priority, float] = {}
    for part in text.split(","):
        name, sep, value = part.strip().partition("=")
        if not sep or name not in Priority.__members__.values() or Priority(name) in shares:
            raise ValueError(f"{part.strip()!r}: expected <class>=<share>, class one of {CLASSES}, each once")
        try:
            shares[Priority(name)] = float(value)
        except ValueError:
            raise ValueError(f"{part.strip()!r}: the share must be a number") from None
    return shares
