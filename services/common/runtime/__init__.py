"""The process runtime: what every service does to start, find the others and stop.

- ``config`` — one typed config object per service, from flags and ``KVMESH_*`` variables.
- ``service`` — ``service_main`` and ``ServiceStack`` (acquired in order, released in reverse).
- ``process`` — the event loop, signals, the NATS connection.
- ``discovery`` — the ``KVMESH_INSTANCES`` bucket: registration leases and watchers.
- ``kv_event_stream`` — the JetStream stream of KV events, created on first use.
- ``nats_auth``, ``nats_server``, ``child_process`` — NATS credentials, an embedded server, child processes.
- ``metrics``, ``structured_logging``, ``heap``, ``ports``, ``run_file`` — Prometheus, structlog, the
  frozen start-up heap, free ports and process trees, ``kvmesh up``'s run file.
"""
