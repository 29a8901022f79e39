"""Inference workers: an engine behind ``kvmesh.v1.Worker`` that publishes its KV events.

- ``server`` — ``kvmesh worker``: ``serve()`` as its steps (engine, servicer, registration).
- ``servicer`` — ``kvmesh.v1.Worker``: requests in, tokens out, a split request's KV handoff.
- ``engine`` — the interface every engine implements, and the request and output types it speaks.
- ``engines/`` — one folder per engine (mock, vLLM, served), chosen by one factory.
- ``kv_transfer/`` — moving KV between workers: the KV handoff, its transports, the KV pool.
- ``cache_moves`` — cached blocks handed on by a worker that leaves, imported by one that joins.
- ``event_publisher`` — KV events batched onto the JetStream stream, a publisher per rank and tier.
- ``lora_slots`` — the LoRA adapters a worker holds loaded now.
- ``config``, ``metrics`` — the worker's options; its Prometheus metrics.
"""
