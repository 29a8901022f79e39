"""The planner's memory: every step (what it observed, with the pools it had, and what it decided)
in one SQLite file through aiosqlite.

A restarted planner — after a clean stop or kill -9 — reads its recent steps back and replays them
through a fresh :class:`Planner`, which rebuilds the predictors' windows, the model corrections, the
utilisation cap and the hysteresis memory exactly (the planner is deterministic in its inputs).
SQLite's WAL journal keeps the file whole when the process dies mid-write: a step is either stored
or not.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiosqlite

from kvmesh.planner.decision import Decision, PoolSizes
from kvmesh.planner.load import IntervalObservation, LoadForecast
from kvmesh.planner.planner import Planner

SCHEMA = """
CREATE TABLE IF NOT EXISTS steps (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at_s REAL NOT NULL,
    observation TEXT NOT NULL,
    decision TEXT NOT NULL
);
"""
RESUME_STEPS = 512  # steps replayed on resume: longer than any predictor window or season


def decision_to_dict(decision: Decision) -> dict[str, Any]:
    return dataclasses.asdict(decision)


def decision_from_dict(data: dict[str, Any]) -> Decision:
    return Decision(
        at_s=data["at_s"],
        forecast=LoadForecast(**data["forecast"]),
        wanted=PoolSizes(**data["wanted"]),
        target=PoolSizes(**data["target"]),
        current=PoolSizes(**data["current"]),
        predicted_ttft_ms=data["predicted_ttft_ms"],
        predicted_itl_ms=data["predicted_itl_ms"],
        ttft_correction=data["ttft_correction"],
        itl_correction=data["itl_correction"],
        utilisation_cap=data["utilisation_cap"],
        window_attainment=data.get("window_attainment"),  # absent from steps stored before it was
        worker_startup_s=data.get("worker_startup_s"),  # likewise
    )


@dataclasses.dataclass(frozen=True)
class StoredStep:
    observation: IntervalObservation
    decision: Decision

    def to_dict(self) -> dict[str, Any]:
        """``{"observation": ..., "decision": ...}``: how a step is sent and shown as JSON."""
        return {"observation": dataclasses.asdict(self.observation), "decision": decision_to_dict(self.decision)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StoredStep:
        return cls(IntervalObservation.from_dict(data["observation"]), decision_from_dict(data["decision"]))


class PlannerState:
    """One SQLite file of planner steps. Use as ``async with PlannerState(path) as state``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._db: aiosqlite.Connection | None = None

    async def __aenter__(self) -> PlannerState:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = await aiosqlite.connect(self.path)
        await self._db.execute("PRAGMA journal_mode=WAL")
        await self._db.executescript(SCHEMA)
        await self._db.commit()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._db is not None:
            await self._db.close()
            self._db = None

    @property
    def db(self) -> aiosqlite.Connection:
        if self._db is None:
            raise RuntimeError("PlannerState is not open")
        return self._db

    async def record(self, observation: IntervalObservation, decision: Decision) -> None:
        await self.db.execute(
            "INSERT INTO steps (at_s, observation, decision) VALUES (?, ?, ?)",
            (decision.at_s, json.dumps(dataclasses.asdict(observation)), json.dumps(decision_to_dict(decision))),
        )
        await self.db.commit()

    async def recent(self, limit: int) -> list[StoredStep]:
        """The last ``limit`` steps, oldest first."""
        cursor = await self.db.execute("SELECT observation, decision FROM steps ORDER BY id DESC LIMIT ?", (limit,))
        rows = await cursor.fetchall()
        return [
            StoredStep(IntervalObservation.from_dict(json.loads(obs)), decision_from_dict(json.loads(dec)))
            for obs, dec in reversed(rows)
        ]

    async def count(self) -> int:
        cursor = await self.db.execute("SELECT COUNT(*) FROM steps")
        (count,) = await cursor.fetchone()
        return int(count)


def resume(planner: Planner, steps: Sequence[StoredStep]) -> Decision | None:
    """Replay stored steps through a fresh planner; returns its last decision (None: no history)."""
    last = None
    for step in steps:
        last = planner.step(step.observation, step.decision.current)
    return last
