"""The mock engine: a real paged KV block manager under a simulated batch scheduler (sans-I/O).

- ``setup`` — the engine as a worker starts it: its buffer, publishers, ranks and KV transfer.
- ``mock_engine`` — the scheduler: admission, prefill and decode steps, the timing model's durations.
- ``request`` — one sequence inside the engine.
- ``kv_cache_manager`` — a request's blocks: prefix caching, reservation, the host tier's reloads.
- ``block_manager`` — the block pool: reference counts, LRU eviction, the KV events it queues.
- ``block_moves`` — cached blocks offered to, and taken from, another worker.
- ``host_tier`` — evicted blocks kept in host memory, reloaded for a later request.
- ``engine_loop`` — the asyncio loop that steps the engine in real time and publishes its events.
"""
