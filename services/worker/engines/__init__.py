"""The engines a worker can run, one folder each, chosen by ``--engine`` in one factory.

- ``factory`` — ``start_engine``: the named engine's setup.
- ``started`` — what every setup takes (the event publishers) and gives back (``StartedEngine``).
- ``mock/`` — the simulated engine: a paged KV cache, a batch scheduler and a timing model.
- ``vllm/`` — vLLM's v1 engine in-process, its KV events relayed, its NIXL connector.
- ``served/`` — a running OpenAI-compatible engine server the worker fronts.
- ``streaming_engine`` — what the vLLM and served engines share (a task per request).
"""
