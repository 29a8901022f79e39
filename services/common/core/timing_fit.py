"""Learning a worker's step-time model from the steps it runs (sans-I/O).

The router's ``ttft`` cost predicts with :class:`TimingModel`; its constants are exact for the mock
engine and unknown for a real one. :class:`TimingFit` fits them online by least squares over the
observed steps,

    step ms = a·T² + b·T + c·[T > 0] + d·u² + e·u + f·[decoding]

(T: prefill tokens of the step, u: decoding context ÷ KV capacity), pulled toward a prior model with
the weight of ``prior_weight`` observations — so a few steps move it a little and many steps decide —
and with exponential forgetting (``decay`` per observation) so it follows an engine whose speed
changes. Features are scaled (T in thousands) to keep the 6×6 system well conditioned.

The fit is constrained to models that make sense: no negative time and no step that gets faster
with more tokens or more context. Unconstrained, a noisy engine (vLLM on a busy CPU, steps of a few
hundred tokens) once fitted a prefill curve that was negative at 1,000 tokens, and the router would
have preferred workers for the prompts they would take longest on. The decode term is written as
``q·(u − u²/2) + p·u²/2 + f`` (``q``: its slope at u = 0, ``p``: at u = 1, so e = q and d = (p − q)/2);
it is non-decreasing on [0, 1] exactly when p, q ≥ 0, and the prefill term when a, b ≥ 0. Every
coefficient is then ≥ 0, which non-negative least squares (SciPy's NNLS) enforces.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.linalg import cho_factor, solve_triangular
from scipy.optimize import nnls

from kvmesh.common.core.timing import TimingModel

_T_SCALE = 1000.0
_FEATURES = 6
# steps held before they are folded into the normal equations in one vectorised update: an engine
# steps hundreds of times a second, and a numpy update per step cost the mock worker ~5% of its CPU
_FOLD_EVERY = 256


def _features(prefill_tokens: int, utilisation: float, decoding: bool) -> tuple[float, ...]:
    t = prefill_tokens / _T_SCALE
    prefilling = 1.0 if prefill_tokens > 0 else 0.0
    u = utilisation if decoding else 0.0
    return (t * t, t, prefilling, u - u * u / 2, u * u / 2, 1.0 if decoding else 0.0)


def as_vector(model: TimingModel) -> np.ndarray:
    """The model in the fit's coordinates (decode slopes at u = 0 and u = 1), each ≥ 0 for a model
    that makes sense; a prior that does not is projected onto the nearest one that does."""
    scale = _T_SCALE
    slope_at_0 = model.decode_b
    slope_at_1 = model.decode_b + 2 * model.decode_a
    theta = np.array(
        [
            model.prefill_a * scale * scale,
            model.prefill_b * scale,
            model.prefill_c,
            slope_at_0,
            slope_at_1,
            model.decode_c,
        ]
    )
    return np.maximum(theta, 0.0)


def as_model(theta: np.ndarray) -> TimingModel:
    scale = _T_SCALE
    slope_at_0, slope_at_1 = float(theta[3]), float(theta[4])
    return TimingModel(
        prefill_a=float(theta[0] / (scale * scale)),
        prefill_b=float(theta[1] / scale),
        prefill_c=float(theta[2]),
        decode_a=(slope_at_1 - slope_at_0) / 2,
        decode_b=slope_at_0,
        decode_c=float(theta[5]),
    )


class TimingFit:
    """Guarantees: :meth:`model` is the prior until steps are observed, and converges to the least
    squares fit of the observed steps, among models with no negative or decreasing step time, as
    their weight outgrows the prior's. Every model it returns predicts step times that are ≥ 0 and
    non-decreasing in prefill tokens and in decoding context."""

    def __init__(self, prior: TimingModel, prior_weight: float = 1.0, decay: float = 0.9995) -> None:
        self.prior = prior
        self.prior_weight = prior_weight
        self.decay = decay
        self._theta_prior = as_vector(prior)
        self._xtx = np.zeros((_FEATURES, _FEATURES))
        self._xty = np.zeros(_FEATURES)
        self._weight = 0.0  # the steps' decayed count
        self._held: list[tuple[float, ...]] = []  # (features..., ms) of steps not yet folded in
        self.observations = 0

    def observe(self, prefill_tokens: int, decode_context: float, capacity: float, decoding: bool, ms: float) -> bool:
        """One engine step: its prefill tokens, its decoding context out of the KV capacity (tokens
        over tokens, or a share over 1) and its measured duration (ms, unscaled: the engine's real
        time). A step that neither prefilled nor decoded says nothing and is skipped; returns
        whether the step was counted."""
        if not prefill_tokens and not decoding:
            return False
        utilisation = min(1.0, decode_context / capacity) if capacity else 0.0
        self._held.append((*_features(prefill_tokens, utilisation, decoding), ms))
        self.observations += 1
        if len(self._held) >= _FOLD_EVERY:
            self._fold()
        return True

    def _fold(self) -> None:
        """Fold the held steps into the decayed sums, exactly as one update per step would:
        step i of n is weighted decay^(n-1-i), and the earlier sums decay^n."""
        if not self._held:
            return
        held = np.array(self._held)
        self._held = []
        x, ms = held[:, :_FEATURES], held[:, _FEATURES]
        weights = self.decay ** np.arange(len(held) - 1, -1, -1, dtype=float)
        weighted = x * weights[:, None]
        carried = self.decay ** len(held)
        self._xtx = carried * self._xtx + weighted.T @ x
        self._xty = carried * self._xty + weighted.T @ ms
        self._weight = carried * self._weight + float(weights.sum())

    def evidence(self) -> TimingEvidence:
        """The steps observed so far, as the decayed sums a fit solves (for pooling a fleet's steps)."""
        self._fold()
        return TimingEvidence(self._xtx.copy(), self._xty.copy(), self._weight)

    def model(self) -> TimingModel:
        if not self.observations:
            return self.prior
        self._fold()
        return as_model(solve(self._xtx, self._xty, self.prior_weight, self._theta_prior))


@dataclass(frozen=True)
class TimingEvidence:
    """A worker's observed steps as the sums a least-squares fit needs: ``xtx`` (XᵀX) and ``xty``
    (Xᵀy) over the fit's scaled features, and ``steps``, their decayed count."""

    xtx: np.ndarray
    xty: np.ndarray
    steps: float

    def to_wire(self) -> dict[str, list[float] | float]:
        """A plain form for a discovery record: XᵀX's upper triangle (it is symmetric), Xᵀy, steps."""
        upper = self.xtx[np.triu_indices(_FEATURES)]
        return {"xtx": [float(v) for v in upper], "xty": [float(v) for v in self.xty], "steps": float(self.steps)}

    @classmethod
    def from_wire(cls, wire: dict) -> TimingEvidence:
        """Raises ValueError (or KeyError, TypeError) for a form :meth:`to_wire` did not make."""
        upper = np.asarray(wire["xtx"], dtype=float)
        xty = np.asarray(wire["xty"], dtype=float)
        steps = float(wire["steps"])
        if upper.shape != (_FEATURES * (_FEATURES + 1) // 2,) or xty.shape != (_FEATURES,) or steps < 0:
            raise ValueError("timing evidence of the wrong shape")
        if not (np.isfinite(upper).all() and np.isfinite(xty).all() and np.isfinite(steps)):
            raise ValueError("timing evidence that is not finite")
        xtx = np.zeros((_FEATURES, _FEATURES))
        xtx[np.triu_indices(_FEATURES)] = upper
        xtx = xtx + np.triu(xtx, 1).T
        return cls(xtx, xty, steps)


def solve(xtx: np.ndarray, xty: np.ndarray, prior_weight: float, theta_prior: np.ndarray) -> np.ndarray:
    """The fit's coefficients: least squares over the sums, pulled toward ``theta_prior`` with the
    weight of ``prior_weight`` observations, every coefficient ≥ 0."""
    # Minimise θᵀAθ − 2bᵀθ over θ ≥ 0: with A = LLᵀ that is ‖Lᵀθ − L⁻¹b‖² plus a constant.
    system = xtx + prior_weight * np.eye(_FEATURES)
    target = xty + prior_weight * theta_prior
    lower, _ = cho_factor(system, lower=True)
    lower = np.tril(lower)
    theta, _residual = nnls(lower.T, solve_triangular(lower, target, lower=True))
    return theta
