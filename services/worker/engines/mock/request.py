"""One sequence inside the mock engine: the state its scheduler (:mod:`.mock_engine`) and its KV
cache manager (:mod:`.kv_cache_manager`) both read and write."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvmesh.worker.engines.mock.block_manager import KvBlock


@dataclass(eq=False)
class EngineRequest:
    """One sequence inside the engine: its tokens, its blocks and how far its KV is computed."""

    request_id: str
    prompt: Sequence[int]
    max_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    seed: int = 0
    lora_name: str | None = None
    output: list[int] = field(default_factory=list)
    num_computed: int = 0
    blocks: list[KvBlock] = field(default_factory=list)
    num_registered: int = 0
    cached_tokens: int | None = None  # prompt tokens found in the cache at first admission
    prompt_key: int = 0
    local_hashes: list[int] = field(default_factory=list)
    seq_hashes: list[int] = field(default_factory=list)
    # Keep the blocks referenced after the last token (a prefill whose KV another worker will pull).
    hold_on_finish: bool = False
    reloaded_blocks: int = 0  # blocks its admission reloaded from the host tier (paid in that step)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def num_pending(self) -> int:
        return self.num_tokens - self.num_computed

    def token_at(self, index: int) -> int:
        n = len(self.prompt)
        return self.prompt[index] if index < n else self.output[index - n]
