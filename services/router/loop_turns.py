"""Loop turns of requests that name no session (sans-I/O, clock passed in; docs/decisions/0054).

An agent's next step sends its whole last prompt again, with the answer and a tool's output
appended, seconds after the last: its prompt *contains* the last one, and that one, routed seconds
after a prompt it contained in turn, was a step too (two quick turns in a row; one alone is as often
a person's quick reply: docs/decisions/0064). A sequence hash names a block
with its whole prefix, so "contains" is one lookup per block: the prompt's blocks are looked up
among the last full blocks of the prompts routed within ``within_s``. Only a prompt whose last full
block was cached nowhere is kept: one that ends inside a prefix many share (a system prompt and a
message shorter than a block) would otherwise make every later prompt with that prefix a "turn".
The duplicate penalty spares such a turn as it spares a named session's
(``SessionAffinity.continues_loop``), so anonymous agent traffic is not held behind itself on a busy
holder.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence


class LoopTurns:
    """Guarantees: :meth:`continues` is True exactly when a proper prefix of the prompt's full blocks
    was a whole prompt (its full blocks, the last one cached nowhere then) recorded within
    ``within_s``, itself recorded within ``within_s`` of a prompt it extended (at most ``max_prompts``
    are kept, the oldest going first); ``within_s`` 0 keeps nothing and answers False."""

    def __init__(self, within_s: float, max_prompts: int = 1 << 17) -> None:
        self.within_s = within_s
        self.max_prompts = max_prompts
        # a prompt's last full block -> when it was routed, and how long after the prompt it extends
        self._last_block_at: OrderedDict[int, tuple[float, float]] = OrderedDict()  # oldest routed first

    def routed(self, block_hashes: Sequence[int], now: float, cached_blocks: int = 0) -> None:
        """A prompt of these full blocks was routed at ``now`` (by this replica or, synced, another);
        ``cached_blocks``: the longest prefix of them known cached anywhere. Kept only where that
        stops short of the last block: what is new in it is then the caller's own."""
        if self.within_s <= 0 or cached_blocks >= len(block_hashes):
            return
        self._expire(now)
        recent = self._last_block_at
        before = max((recent[block][0] for block in block_hashes[:-1] if block in recent), default=None)
        last = block_hashes[-1]
        recent.pop(last, None)
        recent[last] = (now, now - before if before is not None else math.inf)
        while len(self._last_block_at) > self.max_prompts:
            self._last_block_at.popitem(last=False)

    def continues(self, block_hashes: Sequence[int], now: float) -> bool:
        """Whether a prompt of these full blocks extends one routed within ``within_s`` before ``now``
        that extended one routed within ``within_s`` before it. The same prompt again is not a
        continuation (a retry, or another caller's identical prompt)."""
        if self.within_s <= 0 or len(block_hashes) < 2:
            return False
        self._expire(now)
        recent = self._last_block_at
        if not recent:
            return False
        return any(recent[block][1] < self.within_s for block in block_hashes[:-1] if block in recent)

    def __len__(self) -> int:
        return len(self._last_block_at)

    def _expire(self, now: float) -> None:
        recent = self._last_block_at
        while recent:
            at = next(iter(recent.values()))[0]
            if now - at < self.within_s:
                break
            recent.popitem(last=False)
