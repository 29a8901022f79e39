"""Mooncake-format request traces and the deterministic prompts they stand for.

A trace line is ``{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}``, and may
name its session and tenant (``"session_id"``, ``"tenant"``: session-structured traces,
:mod:`kvmesh.replay.session_trace`).
Each hash id stands for ``trace_block_size`` tokens (512 in the Mooncake release); requests that
share their first k hash ids share a prompt prefix of k blocks. Hash id ``h`` expands to the token
ids ``h·B, h·B + 1, …, h·B + B − 1`` (B = trace block size): distinct per hash id, identical
wherever the id repeats. The prompt is the concatenation, cut to ``input_length``.
"""

from __future__ import annotations

import json
from array import array
from dataclasses import dataclass
from pathlib import Path

from kvmesh.common.wire.hashing import local_block_hashes


class TraceError(ValueError):
    """A trace file that cannot be replayed; the message names the line."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    session: str | None = None  # the session (conversation, agent loop) it belongs to, if named
    tenant: str | None = None


def read_trace(path: Path) -> list[TraceRequest]:
    """Parse a Mooncake JSONL trace, sorted by timestamp (stable for equal ones)."""
    requests = []
    with path.open() as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
                request = TraceRequest(
                    float(raw["timestamp"]),
                    int(raw["input_length"]),
                    int(raw["output_length"]),
                    tuple(int(h) for h in raw["hash_ids"]),
                    _optional_name(raw, "session_id"),
                    _optional_name(raw, "tenant"),
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise TraceError(f"{path}:{number}: not a trace request ({exc})") from exc
            if request.input_length <= 0 or request.output_length <= 0:
                raise TraceError(f"{path}:{number}: input_length and output_length must be positive")
            requests.append(request)
    requests.sort(key=lambda r: r.timestamp_ms)
    return requests


def _optional_name(raw: dict, field: str) -> str | None:
    value = raw.get(field)
    if value is None:
        return None
    if not isinstance(value, str | int) or not str(value):
        raise ValueError(f"{field} must be a non-empty string")
    return str(value)


class PromptBuilder:
    """Builds prompts (``array('I')``) and their local block hashes for trace requests.

    Local hashes of a hash id's tokens are computed once and reused wherever the id appears, when
    the engine's block size divides the trace block size; otherwise they are hashed per request.
    """

    def __init__(self, trace_block_size: int, block_size: int) -> None:
        if trace_block_size <= 0 or block_size <= 0:
            raise ValueError("block sizes must be positive")
        self.trace_block_size = trace_block_size
        self.block_size = block_size
        self._aligned = trace_block_size % block_size == 0
        self._local_cache: dict[int, list[int]] = {}

    def tokens(self, request: TraceRequest) -> array:
        size = self.trace_block_size
        prompt = array("I")
        for h in request.hash_ids:
            prompt.extend(range(h * size, (h + 1) * size))
            if len(prompt) >= request.input_length:
                break
        if len(prompt) < request.input_length:
            raise TraceError(
                f"input_length {request.input_length} exceeds {len(request.hash_ids)} hash ids × {size} tokens"
            )
        del prompt[request.input_length :]
        return prompt

    def local_hashes(self, request: TraceRequest, prompt: array) -> list[int]:
        if not self._aligned:
            return local_block_hashes(prompt, self.block_size)
        per_id = self.trace_block_size // self.block_size
        full = request.input_length // self.block_size
        hashes: list[int] = []
        for index, h in enumerate(request.hash_ids):
            if len(hashes) >= full:
                break
            cached = self._local_cache.get(h)
            if cached is None:
                start = index * self.trace_block_size
                cached = local_block_hashes(prompt[start : start + self.trace_block_size], self.block_size)
                if len(cached) == per_id:  # only a whole trace block may be cached for reuse
                    self._local_cache[h] = cached
            hashes.extend(cached)
        return hashes[:full]
