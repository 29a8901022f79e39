"""What ``kvmesh bench`` sends: prompts built from a Mooncake trace, or a synthetic shared-prefix set.

Trace prompts. A hash id stands for ``trace_block_size`` tokens and requests that share their first
k hash ids must share their first k blocks of tokens *after tokenisation*. Each hash id becomes a
text block of pseudo-random words, cut with the target tokenizer to exactly ``trace_block_size``
tokens and ending in a newline, so that no token merges across a block boundary; a prompt is the
concatenation, cut to ``input_length`` tokens. :func:`check_shared_prefixes` tokenises every whole
prompt and verifies it. A prompt has no text past its last hash id, so a request longer than its hash
ids' tokens is sent shorter: :func:`as_sent` is the trace as sent, for what a window lets any router
keep (:func:`~kvmesh.replay.bounds.reuse_bounds`).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.frontend.tokenizer import ModelTokenizer
from kvmesh.replay.mooncake_trace import TraceRequest

_WORDS = [
    "cache",
    "prefix",
    "block",
    "router",
    "worker",
    "token",
    "decode",
    "prefill",
    "latency",
    "batch",
    "queue",
    "stream",
    "event",
    "index",
    "replica",
    "shard",
    "model",
    "layer",
    "head",
    "tensor",
    "memory",
    "budget",
    "schedule",
    "request",
    "answer",
    "reuse",
]


@dataclass(frozen=True)
class BenchRequest:
    """One request to send: when (seconds after start, or None in closed-loop mode) and what."""

    index: int
    send_at_s: float | None
    prompt: str
    prompt_tokens: int
    max_tokens: int
    hash_ids: tuple[int, ...] = ()
    priority: str = ""  # sent as x-kvmesh-priority (empty: no header)
    session: str = ""  # the trace's session id, sent as x-session-id (empty: no header)
    after: int | None = None  # the request (its session's previous turn) whose answer it waits for
    reply_prompt: str = ""  # its context through its reply, cached on its worker after its answer


class TracePromptBuilder:
    """Turns trace hash ids into text whose tokens line up with the trace's blocks."""

    def __init__(self, tokenizer: ModelTokenizer, trace_block_size: int) -> None:
        self.tokenizer = tokenizer
        self.block_size = trace_block_size
        self._blocks: dict[int, tuple[str, list[int]]] = {}

    def block(self, hash_id: int) -> tuple[str, list[int]]:
        """(text, token ids) of one hash id: exactly ``block_size`` tokens, the last a newline."""
        cached = self._blocks.get(hash_id)
        if cached is not None:
            return cached
        rng = random.Random(hash_id)
        words: list[str] = []
        # Grow until the text has more tokens than a block, then cut on a token boundary.
        while len(self.tokenizer.encode(" ".join(words))) < self.block_size + 8:
            words.extend(rng.choice(_WORDS) for _ in range(self.block_size // 2 + 8))
        ids = self.tokenizer.encode(" ".join(words))[: self.block_size - 1] + self.tokenizer.encode("\n")
        text = self.tokenizer.decode(ids)
        ids = self.tokenizer.encode(text)
        if len(ids) != self.block_size:
            raise ValueError(f"cannot build a {self.block_size}-token block for hash id {hash_id} with this tokenizer")
        self._blocks[hash_id] = (text, ids)
        return text, ids

    def prompt(self, request: TraceRequest) -> tuple[str, list[int]]:
        """The prompt text of a trace request and the token ids it must tokenise to: :func:`sent_length`
        of them."""
        length = sent_length(request, self.block_size)
        texts: list[str] = []
        ids: list[int] = []
        for h in request.hash_ids:
            text, block_ids = self.block(h)
            texts.append(text)
            ids.extend(block_ids)
            if len(ids) >= length:
                break
        ids = ids[:length]
        whole_blocks, remainder = divmod(len(ids), self.block_size)
        text = "".join(texts[:whole_blocks])
        if remainder:
            text += self.tokenizer.decode(self.block(request.hash_ids[whole_blocks])[1][:remainder])
        return text, ids


def sent_length(request: TraceRequest, block_size: int) -> int:
    """The tokens of ``request``'s prompt with ``block_size`` tokens a hash id: its length, or its hash
    ids' tokens where those are fewer (the prompt is made of their text alone)."""
    return min(request.input_length, len(request.hash_ids) * block_size)


def as_sent(trace: Sequence[TraceRequest], block_size: int) -> list[TraceRequest]:
    """``trace`` with each request's length as :class:`TracePromptBuilder` sends it (:func:`sent_length`).
    Why: a live window of a trace made with 512-token blocks, sent at 32 tokens a hash id, holds prompts
    about a sixteenth as long as the trace's lengths say, so a bound read off those lengths means nothing there."""
    return [dataclasses.replace(request, input_length=sent_length(request, block_size)) for request in trace]


@dataclass(frozen=True)
class PrefixCheck:
    checked: int
    mismatched: int
    first_mismatch: int | None


def check_shared_prefixes(tokenizer: ModelTokenizer, requests: Sequence[BenchRequest], block_size: int) -> PrefixCheck:
    """Tokenise every prompt and check each shared run of hash ids gives the same tokens."""
    seen: dict[tuple[int, ...], list[int]] = {}
    mismatched = 0
    first: int | None = None
    for request in requests:
        ids = tokenizer.encode(request.prompt)
        ok = True
        for k in range(1, len(request.hash_ids) + 1):
            if k * block_size > len(ids):
                break
            key = request.hash_ids[:k]
            block = ids[(k - 1) * block_size : k * block_size]
            expected = seen.setdefault(key, block)
            if expected != block:
                ok = False
                break
        if not ok:
            mismatched += 1
            first = request.index if first is None else first
    return PrefixCheck(len(requests), mismatched, first)


def trace_workload(
    trace: Sequence[TraceRequest],
    builder: TracePromptBuilder,
    arrival_speedup_ratio: float,
    max_output_tokens: int | None,
) -> list[BenchRequest]:
    start = trace[0].timestamp_ms if trace else 0.0
    requests = []
    for index, row in enumerate(trace):
        text, ids = builder.prompt(row)
        output = row.output_length if max_output_tokens is None else min(row.output_length, max_output_tokens)
        requests.append(
            BenchRequest(
                index,
                (row.timestamp_ms - start) / 1000 / arrival_speedup_ratio,
                text,
                len(ids),
                output,
                row.hash_ids,
                session=row.session or "",
            )
        )
    return requests


def synthetic_workload(
    tokenizer: ModelTokenizer,
    num_requests: int,
    num_prefixes: int,
    prefix_tokens: int,
    suffix_tokens: int,
    output_tokens: int,
    seed: int,
) -> list[BenchRequest]:
    """``num_prefixes`` shared system prompts, each request one of them plus its own question."""
    builder = TracePromptBuilder(tokenizer, prefix_tokens)
    rng = random.Random(seed)
    requests = []
    for index in range(num_requests):
        group = rng.randrange(num_prefixes)
        prefix_text, prefix_ids = builder.block(1_000_000 + group)
        question = " ".join(rng.choice(_WORDS) for _ in range(suffix_tokens))
        suffix_ids = tokenizer.encode(question)[:suffix_tokens]
        suffix = tokenizer.decode(suffix_ids)
        requests.append(
            BenchRequest(index, None, prefix_text + suffix, len(prefix_ids) + len(suffix_ids), output_tokens, (group,))
        )
    return requests


def assign_priorities(requests: list[BenchRequest], mix: dict[str, float], seed: int) -> list[BenchRequest]:
    """Each request with a priority class drawn from ``mix`` (class -> share), reproducibly."""
    rng = random.Random(seed)
    classes, weights = list(mix), list(mix.values())
    return [dataclasses.replace(r, priority=rng.choices(classes, weights=weights)[0]) for r in requests]
