"""kvmesh: a KV-cache-aware serving mesh. One folder per service, and the tools beside them.

- ``frontend/`` — the OpenAI-compatible HTTP facade.
- ``router/`` — the routing pipeline and the request path's planning (``kvmesh.v1.Router``).
- ``indexer/`` — indexer replicas: the prefix index fed from the JetStream KV event stream.
- ``worker/`` — an engine (mock, vLLM, served) behind ``kvmesh.v1.Worker``.
- ``planner/`` — sizes the worker pools to meet TTFT / ITL targets.
- ``common/`` — what the services share, by layer.
- ``up/`` — ``kvmesh up``: a whole mesh on one machine.
- ``replay/`` — ``kvmesh replay``: the routing pipeline and mock engine in virtual time.
- ``profiler/``, ``loadgen/`` — ``kvmesh profile`` and ``kvmesh bench``.
- ``devtools/`` — what developers use and users do not (the test harness, drills, protogen).
- ``cli`` — the ``kvmesh`` command: one entry point for every service and tool.
- ``client`` — a small typed Python client for the router's gRPC API.
- ``inspector`` — ``kvmesh inspect``: what each replica and worker holds or sees.
- ``worker_pool`` — the worker pools of a ``kvmesh up`` mesh that the planner resizes.
"""
