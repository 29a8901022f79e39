"""A measured engine profile: how long a prefill takes by uncached prompt length, and how long a
decode step takes by concurrency and context. ``kvmesh profile`` writes one; the planner sizes
worker pools from it.

The profile is measured, not assumed: the same file format describes the mock engine (whose
measurements must agree with its timing model) and a real one.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

PROFILE_VERSION = 1


class ProfileError(ValueError):
    """A profile file that cannot be used: unreadable, wrong version, or too few points."""


@dataclass(frozen=True)
class PrefillPoint:
    uncached_tokens: int
    ttft_ms: float  # the prefill alone on an idle worker: arrival to first token


@dataclass(frozen=True)
class DecodePoint:
    concurrency: int
    context_tokens: int  # per sequence
    itl_ms: float  # mean time between tokens while this many sequences decode


@dataclass(frozen=True)
class EngineProfile:
    """Interpolates measured points; outside the measured range it extends the nearest segment's
    slope (prefill) or clamps (decode), so an estimate is never negative."""

    engine: str
    prefill: tuple[PrefillPoint, ...]
    decode: tuple[DecodePoint, ...]
    max_num_batched_tokens: int
    capacity_tokens: int  # KV cache capacity of one worker
    notes: dict[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.prefill) < 2 or len(self.decode) < 1:
            raise ProfileError("a profile needs at least two prefill points and one decode point")

    # ---- estimates -----------------------------------------------------------------------------
    def ttft_ms(self, uncached_tokens: float) -> float:
        """Prefill time of a prompt with this many uncached tokens, on an idle worker."""
        points = sorted(self.prefill, key=lambda p: p.uncached_tokens)
        xs = [p.uncached_tokens for p in points]
        i = min(max(bisect.bisect_left(xs, uncached_tokens), 1), len(xs) - 1)
        left, right = points[i - 1], points[i]
        slope = (right.ttft_ms - left.ttft_ms) / (right.uncached_tokens - left.uncached_tokens)
        return max(0.0, left.ttft_ms + slope * (uncached_tokens - left.uncached_tokens))

    def itl_ms(self, concurrency: float, context_tokens: float) -> float:
        """Decode step time with ``concurrency`` sequences of ``context_tokens`` each: inverse-distance
        weighting over the nearest measured points in (concurrency × context) tokens, the quantity
        a decode step's cost follows."""
        load = max(concurrency, 1.0) * context_tokens
        points = sorted(self.decode, key=lambda p: p.concurrency * p.context_tokens)
        loads = [p.concurrency * p.context_tokens for p in points]
        if load <= loads[0]:
            return points[0].itl_ms
        if load >= loads[-1]:
            return points[-1].itl_ms
        i = bisect.bisect_left(loads, load)
        left, right = points[i - 1], points[i]
        if loads[i] == loads[i - 1]:
            return (left.itl_ms + right.itl_ms) / 2
        share = (load - loads[i - 1]) / (loads[i] - loads[i - 1])
        return left.itl_ms + share * (right.itl_ms - left.itl_ms)

    # ---- file ----------------------------------------------------------------------------------
    def save(self, path: Path) -> None:
        data = {"version": PROFILE_VERSION, **asdict(self)}
        path.write_text(json.dumps(data, indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> EngineProfile:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ProfileError(f"cannot read engine profile {path}: {exc}") from exc
        if data.get("version") != PROFILE_VERSION:
            raise ProfileError(f"{path}: profile version {data.get('version')!r}, expected {PROFILE_VERSION}")
        try:
            return cls(
                engine=data["engine"],
                prefill=tuple(PrefillPoint(**p) for p in data["prefill"]),
                decode=tuple(DecodePoint(**p) for p in data["decode"]),
                max_num_batched_tokens=data["max_num_batched_tokens"],
                capacity_tokens=data["capacity_tokens"],
                notes=data.get("notes", {}),
            )
        except (KeyError, TypeError) as exc:
            raise ProfileError(f"{path}: not an engine profile ({exc})") from exc
