"""The engine step-time model: the mock engine runs on it and the router predicts with it.

Defaults are the published constants of NVIDIA Dynamo's mocker, so our simulations compare with its:

    prefill ms = 4.209989e-7·T² + 1.518344e-2·T + 16.50142   (T = uncached prompt tokens in the step;
                                                             0 when the step prefills nothing)
    decode ms  = max(1, −25.74·u² + 54.01·u + 5.74)          (u = decoding context tokens ÷ KV capacity
                                                             in tokens, capped at 1; 0 when nothing decodes)

A step takes prefill ms + decode ms, divided by the speed-up ratio.
"""

from __future__ import annotations

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
