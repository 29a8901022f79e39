"""``kvmesh profile``: measure an engine's prefill and decode times into an engine profile.

- ``cli`` — the command.
- ``mock`` — profile the mock engine by running it.
- ``live`` — profile a running worker (mock or vLLM) over its gRPC API.
"""
