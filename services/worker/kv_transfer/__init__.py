"""Moving KV between workers: a prefill worker's blocks into a decode worker's cache.

- ``handoff`` — a worker's half of the KV handoff over its own transport (the mock engine's).
- ``connector_handoff`` — the same over an engine's own connector (vLLM's NIXL connector).
- ``transport`` — the transfer server and client: a room per prefill, bytes over TCP or NIXL.
- ``messages`` — the transport's typed frames.
- ``nixl_agent`` — NIXL (UCX, DRAM) reads of a peer's registered KV buffer.
- ``kv_buffer`` — the worker's KV bytes, block by block, and their layout.
- ``kv_pool`` — a host's shared-memory pool of KV segments several workers read.
- ``pool_writer`` — a worker's blocks copied into its pool segment, announced as KV events.
"""
