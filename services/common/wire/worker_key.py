"""How every service names one engine instance: ``(worker_id, dp_rank)``.

A worker process may run several data-parallel ranks, each with its own KV cache; the prefix index,
the router's load picture and its cost function all key on the pair.
"""

WorkerKey = tuple[int, int]
