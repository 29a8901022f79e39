"""The mock worker's KV cache bytes: one contiguous buffer, one fixed-size region per block slot.

A real engine keeps, per token, a key and a value vector for every layer and KV head. The mock
engine computes nothing, but it holds real memory of that shape so that disaggregation moves real
bytes: when a block is computed, its region is filled with a pattern derived from the block's
sequence hash (which identifies the block *and its whole prefix*, as the real KV values would), and
a worker that receives a block over a KV transfer can check every byte it got against the pattern
it would have computed itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def contiguous_runs(first: Sequence[int], second: Sequence[int]) -> list[tuple[int, int, int]]:
    """(start in first, start in second, count) of the runs where both sequences advance by one."""
    runs: list[tuple[int, int, int]] = []
    for a, b in zip(first, second, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == a and runs[-1][1] + runs[-1][2] == b:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((a, b, 1))
    return runs


@dataclass(frozen=True)
class KvLayout:
    """The model shape that sizes the KV cache. Small defaults: 512 bytes per token."""

    num_layers: int = 2
    num_kv_heads: int = 2
    head_dim: int = 32
    dtype_bytes: int = 2

    @property
    def bytes_per_token(self) -> int:
        # key and value, for every layer and KV head
        return self.num_layers * self.num_kv_heads * self.head_dim * 2 * self.dtype_bytes

    def block_bytes(self, block_size: int) -> int:
        return self.bytes_per_token * block_size


class KvBuffer:
    """``num_blocks`` regions of ``block_bytes`` each, in one numpy buffer (so its address can be
    registered with NIXL). Pages are touched only when written, so an idle worker costs little."""

    def __init__(self, num_blocks: int, block_bytes: int) -> None:
        if block_bytes <= 0 or block_bytes % 8:
            raise ValueError(f"block_bytes must be a positive multiple of 8, not {block_bytes}")
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.data = np.zeros(num_blocks * block_bytes, dtype=np.uint8)
        self._words = self.data.view(np.uint64)
        self._words_per_block = block_bytes // 8

    @property
    def address(self) -> int:
        return int(self.data.ctypes.data)

    @property
    def size(self) -> int:
        return int(self.data.nbytes)

    def offset(self, slot: int) -> int:
        return slot * self.block_bytes

    def region(self, slot: int) -> memoryview:
        start = slot * self.block_bytes
        return memoryview(self.data[start : start + self.block_bytes])

    def fill(self, slot: int, content: int) -> None:
        """Write the block computed for ``content`` (its sequence hash) into ``slot``."""
        start = slot * self._words_per_block
        self._words[start : start + self._words_per_block] = np.uint64(content)

    def holds(self, slot: int, content: int) -> bool:
        """Whether ``slot`` holds exactly the bytes :meth:`fill` writes for ``content``."""
        start = slot * self._words_per_block
        return bool(np.all(self._words[start : start + self._words_per_block] == np.uint64(content)))

    def fill_many(self, slots: Sequence[int], contents: Sequence[int]) -> None:
        """:meth:`fill` for many blocks in one vectorised write (a long prompt has thousands)."""
        if slots:
            blocks = self._words.reshape(self.num_blocks, self._words_per_block)
            blocks[np.asarray(slots, dtype=np.intp)] = np.asarray(contents, dtype=np.uint64)[:, None]

    def count_mismatches(self, slots: Sequence[int], contents: Sequence[int]) -> int:
        """How many of these slots do not hold what :meth:`fill` writes for their content."""
        blocks = self._words.reshape(self.num_blocks, self._words_per_block)
        expected = np.asarray(contents, dtype=np.uint64)[:, None]
        bad = 0
        # runs of consecutive slots are compared as views (no gathered copy of the blocks)
        for slot, index, count in contiguous_runs(slots, range(len(slots))):
            run = blocks[slot : slot + count] == expected[index : index + count]
            bad += int(np.count_nonzero(~np.all(run, axis=1)))
        return bad
