"""A running OpenAI-compatible engine server (vLLM's or another) fronted by a worker.

- ``setup`` — the engine as a worker starts it.
- ``served_engine`` — token ids in and out over HTTP, its ZMQ KV events relayed with replay.
"""
