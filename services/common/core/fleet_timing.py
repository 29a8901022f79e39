"""One step-time model for a fleet of like engines, scaled to each engine's speed (sans-I/O).

Each worker fits its own steps (:class:`~kvmesh.common.core.timing_fit.TimingFit`). Fitted apart,
equal engines disagree: six constants are poorly fixed by one engine's noisy steps, most of them
short. Live, on three vLLM CPU workers of equal speed, a 3,000-token prefill was predicted at 807,
1,175 and 1,891 ms, and the router sent nearly every new prompt to the worker fitted fastest
(docs/decisions/0061). Pooled, the fleet's steps fix the model's shape: how a step's time grows
with its tokens and its decoding context. Each worker's own steps then fix one number, its speed
against that shape, which a few hundred steps determine well. A worker twice as slow as the others
is still costed twice as slow. Workers of one speed class share one speed, fitted to their steps
together: a speed measured per worker reads the load the router put on it as the engine's
(docs/decisions/0062).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

import numpy as np

from kvmesh.common.core.timing import TimingModel
from kvmesh.common.core.timing_fit import TimingEvidence, as_model, as_vector, solve

# A worker's speed is pulled toward the pool's with the weight of this many typical steps: one that
# has run only a few is costed near the fleet's speed, not at whatever those few said. Kept small:
# a deterministic engine's first steps are exact, and with 50 the heterogeneous replay's learned
# TTFT p99 was 5-7% over the exact model's (1,753-1,793 ms against 1,675; 10: 1,613-1,677).
SPEED_PRIOR_STEPS = 10.0
SPEED_LIMITS = (0.1, 10.0)  # a speed outside these is a fit gone wrong, not an engine
ALTERNATIONS = 4  # rounds of fitting the shape and the speeds in turn (the figures settle by the third)


def pooled_speeds(theta: np.ndarray, xtx: np.ndarray, xty: np.ndarray, typical_square: float) -> np.ndarray:
    """Each worker's factor ``s`` that best fits its steps as ``s`` times the pooled model θ (least
    squares: s = θᵀXᵀy ÷ θᵀXᵀXθ over its sums ``xtx[k]``, ``xty[k]``), pulled toward 1 by
    :data:`SPEED_PRIOR_STEPS` steps of ``typical_square`` (a pooled step's predicted ms, squared,
    on average)."""
    prior = SPEED_PRIOR_STEPS * typical_square
    explained = xty @ theta + prior
    predicted = np.einsum("i,kij,j->k", theta, xtx, theta) + prior
    speeds = np.divide(explained, predicted, out=np.ones_like(explained), where=predicted > 0)
    return np.clip(speeds, *SPEED_LIMITS)


def fleet_models(
    evidence: Mapping[Hashable, TimingEvidence],
    prior: TimingModel,
    prior_weight: float = 1.0,
    speed_classes: Mapping[Hashable, Hashable] | None = None,
) -> dict[Hashable, TimingModel]:
    """Each worker's step-time model ``s·θ``: θ, the shape, fitted to every worker's steps together
    (pulled toward ``prior`` as :class:`TimingFit` pulls one worker's), ``s`` its speed
    (:func:`pooled_speeds`). Shape and speeds are fitted in turn (:data:`ALTERNATIONS` rounds): a
    shape fitted to raw pooled steps leans toward whatever the slow workers ran most, which the
    router chose for them (on the shared trace with 4 of 8 workers 2x slower, it fitted a 300-token
    prefill 16% long and a decode step 26% short). ``speed_classes``: workers of one class (by
    key; a key not in it is a class of its own) share one speed, fitted to their steps together
    (docs/decisions/0062). Every model returned predicts step times ≥ 0 and non-decreasing in
    tokens and context, as a fit's do."""
    if not evidence:
        return {}
    keys = list(evidence)
    xtx = np.stack([evidence[key].xtx for key in keys])
    xty = np.stack([evidence[key].xty for key in keys])
    steps = sum(evidence[key].steps for key in keys)
    xtx_all = xtx.sum(axis=0)
    theta_prior = as_vector(prior)
    classes = speed_classes or {}
    labels: dict[Hashable, int] = {}
    member = np.array([labels.setdefault(classes.get(key, ("worker", key)), len(labels)) for key in keys])
    class_xtx = np.zeros((len(labels), *xtx.shape[1:]))
    class_xty = np.zeros((len(labels), xty.shape[1]))
    np.add.at(class_xtx, member, xtx)
    np.add.at(class_xty, member, xty)
    speeds = np.ones(len(keys))
    for _ in range(ALTERNATIONS):
        # the steps of a worker of speed s are s·(the shape's): least squares of the shape given s
        theta = solve(np.einsum("k,kij->ij", speeds**2, xtx), speeds @ xty, prior_weight, theta_prior)
        typical_square = float(theta @ xtx_all @ theta) / steps if steps > 0 else 0.0
        speeds = pooled_speeds(theta, class_xtx, class_xty, typical_square)[member]
    return {key: as_model(float(speed) * theta) for key, speed in zip(keys, speeds, strict=True)}
