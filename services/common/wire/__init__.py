"""Wire types: what crosses a process boundary, each with its one codec. Imports nothing else of kvmesh.

- ``hashing`` — block and sequence hashes (DESIGN §2), golden vectors in the tests.
- ``kv_events`` — the KV event batch a worker publishes (DESIGN §3).
- ``disagg`` — what rides in ``disaggregated_params``: prefill order, KV ready, decode order, KV source.
- ``request_reports`` — a caller's first-token and end reports to the router on ``RouteMany``.
- ``requests`` — facts about a preprocessed request (a continued try, the usage of a whole answer).
- ``finish_reasons`` — finish reasons between the protos and OpenAI's names.
- ``priority`` — the router queue's priority classes, declared and validated once.
- ``gateway_endpoint`` — the model server address a worker advertises for inference gateways.
- ``session`` — a request's session: the headers that carry one, its one parser.
- ``lora`` — LoRA adapters: names, paths, what a worker's record says it serves and holds.
- ``names`` — every NATS subject, stream and bucket name.
- ``step_timing`` — the step times a worker advertises: its fitted constants and the steps behind them.
- ``worker_key`` — how every service names one engine instance: ``WorkerKey(worker_id, dp_rank)``.
- ``frontend_load`` — what a frontend served, published for the planner.
- ``worker_load`` — each worker's load as a router predicts it, published for the planner.
"""
