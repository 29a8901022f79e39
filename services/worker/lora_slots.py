"""Which of a worker's LoRA adapters are loaded now: at most ``--max-loras`` of those it serves.

A worker serves every adapter ``--lora-adapters`` names, but holds only ``capacity`` loaded at once;
a request for another loads it first, evicting the least recently used. The routers learn the loaded
set from the worker's discovery record (``extra["lora_resident"]``), so that they charge a worker
that must load an adapter for the load.

The mock engine simulates a load's time (``load_s``); vLLM loads an adapter itself on its first
request (its CPU-side cache holds as many as this worker's slots), so there the slots only mirror
what vLLM holds, least recently used first as its cache evicts.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Sequence


class AdapterSlots:
    """The adapters loaded now, most recently used last. Guarantees: never more than ``capacity``
    loaded; concurrent requests for an adapter being loaded wait for that one load; ``changed`` is
    set whenever the loaded set changes (the advertiser clears it)."""

    def __init__(self, adapters: Sequence[str], capacity: int, load_s: float = 0.0) -> None:
        """``capacity`` 0 or at least ``len(adapters)``: every adapter stays loaded. The first
        ``capacity`` adapters start loaded."""
        self.adapters = tuple(adapters)
        self.capacity = capacity if 0 < capacity < len(self.adapters) else len(self.adapters)
        self.load_s = load_s
        self.loads = 0  # adapters loaded on demand since start
        self._loaded: OrderedDict[str, None] = OrderedDict.fromkeys(self.adapters[: self.capacity])
        self._loading: dict[str, asyncio.Future[None]] = {}
        self.changed = asyncio.Event()

    @property
    def limited(self) -> bool:
        """Whether some adapter this worker serves is not loaded at all times."""
        return self.capacity < len(self.adapters)

    def loaded(self) -> list[str]:
        """The adapters loaded now, least recently used first."""
        return list(self._loaded)

    async def use(self, adapter: str) -> bool:
        """Make ``adapter`` (one this worker serves) loaded and most recently used; True when this
        call loaded it."""
        if adapter in self._loaded:
            self._loaded.move_to_end(adapter)
            return False
        pending = self._loading.get(adapter)
        if pending is not None:
            await asyncio.shield(pending)
            return await self.use(adapter)  # loaded by then, unless that load was cancelled
        pending = asyncio.get_running_loop().create_future()
        self._loading[adapter] = pending
        try:
            if self.load_s > 0:
                await asyncio.sleep(self.load_s)  # the simulated load (the mock engine's only)
            while len(self._loaded) >= self.capacity:
                self._loaded.popitem(last=False)
            self._loaded[adapter] = None
            self.loads += 1
            self.changed.set()
        finally:
            del self._loading[adapter]
            pending.set_result(None)
        return True
