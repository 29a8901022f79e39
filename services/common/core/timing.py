"""The engine step-time model: the mock engine runs on it and the router predicts with it.

Defaults are the published constants of NVIDIA Dynamo's mocker, so our simulations compare with its:

    prefill ms = 4.209989e-7·T² + 1.518344e-2·T + 16.50142   (T = uncached prompt tokens in the step;
                                                             0 when the step prefills nothing)
    decode ms  = max(1, −25.74·u² + 54.01·u + 5.74)          (u = decoding context tokens ÷ KV capacity
                                                             in tokens, capped at 1; 0 when nothing decodes)

A step takes prefill ms + decode ms, divided by the speed-up ratio.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class TimingModel:
    prefill_a: float = 4.209989e-7
    prefill_b: float = 1.518344e-2
    prefill_c: float = 16.50142
    decode_a: float = -25.74
    decode_b: float = 54.01
    decode_c: float = 5.74
    speedup_ratio: float = 1.0

    def prefill_ms(self, prefill_tokens: int) -> float:
        if prefill_tokens <= 0:
            return 0.0
        t = float(prefill_tokens)
        return self.prefill_a * t * t + self.prefill_b * t + self.prefill_c

    def decode_ms(self, decode_context_tokens: int, capacity_tokens: int, decoding: bool) -> float:
        if not decoding:
            return 0.0
        u = min(1.0, decode_context_tokens / capacity_tokens)
        return max(1.0, self.decode_a * u * u + self.decode_b * u + self.decode_c)

    def step_ms(self, prefill_tokens: int, decode_context_tokens: int, capacity_tokens: int, decoding: bool) -> float:
        raw = self.prefill_ms(prefill_tokens) + self.decode_ms(decode_context_tokens, capacity_tokens, decoding)
        return raw / self.speedup_ratio


def scaled(model: TimingModel, prefill_factor: float, decode_factor: float | None = None) -> TimingModel:
    """The model with prefill times ``prefill_factor`` times as long and decode times
    ``decode_factor`` times (default: the same factor) — a slower engine, or a prior wrong by that much."""
    decode_factor = prefill_factor if decode_factor is None else decode_factor
    return dataclasses.replace(
        model,
        prefill_a=model.prefill_a * prefill_factor,
        prefill_b=model.prefill_b * prefill_factor,
        prefill_c=model.prefill_c * prefill_factor,
        decode_a=model.decode_a * decode_factor,
        decode_b=model.decode_b * decode_factor,
        decode_c=model.decode_c * decode_factor,
    )


def real_time(model: TimingModel) -> TimingModel:
    """The same model with its speed-up folded into the constants (``speedup_ratio`` 1): what a fit
    of the steps' measured durations converges to."""
    return dataclasses.replace(scaled(model, 1.0 / model.speedup_ratio), speedup_ratio=1.0)


def as_constants(model: TimingModel) -> dict[str, float]:
    """The model's constants, as a worker advertises them (speed-up folded in)."""
    fitted = real_time(model)
    return {name: getattr(fitted, name) for name in TIMING_CONSTANTS}


def from_constants(constants: dict[str, float]) -> TimingModel:
    return TimingModel(**{name: float(constants[name]) for name in TIMING_CONSTANTS})


TIMING_CONSTANTS = ("prefill_a", "prefill_b", "prefill_c", "decode_a", "decode_b", "decode_c")
