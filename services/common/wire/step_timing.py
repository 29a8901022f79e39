"""The step times a worker advertises in its discovery record (its ``extra``), for the routers'
ttft cost: the constants it fitted, the steps it fitted them on, and its speed class."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

TIMING_KEY = "timing"  # its fitted constants (kvmesh.common.core.timing.as_constants), for all its ranks
TIMING_BY_RANK_KEY = "timing_by_rank"  # rank -> constants, where its ranks are fitted apart
TIMING_EVIDENCE_KEY = "timing_evidence"  # the steps behind TIMING_KEY (TimingEvidence.to_wire)
# workers of one model and one speed class share one speed (docs/decisions/0062): its engine and device
SPEED_CLASS_KEY = "speed_class"


def advertised_timing(extra: Mapping[str, Any], rank: int) -> Any:
    """The step-time constants a worker advertises for one of its ranks (None: none yet)."""
    by_rank = extra.get(TIMING_BY_RANK_KEY)
    if by_rank:
        constants = by_rank.get(str(rank))
        if constants is not None:
            return constants
    return extra.get(TIMING_KEY)


def fitted_apart(extra: Mapping[str, Any], rank: int) -> bool:
    """Whether the worker advertises this rank's own constants (then it is costed with them)."""
    by_rank = extra.get(TIMING_BY_RANK_KEY)
    return bool(by_rank) and str(rank) in by_rank
