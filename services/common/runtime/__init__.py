"""The process runtime: what every service does to start, find the others and stop.

- ``config`` — one typed config object per service, from flags and ``KVMESH_*`` variables.
- ``service`` — ``service_main`` and ``ServiceStack`` (acquired in order, released in reverse).
- ``process`` — the event loop, signals, the NATS connection.
- ``discovery`` — the ``KVMESH_INSTANCES`` bucket: registration leases and watchers.
- ``lease`` — at most one holder of a key at a time (one planner acts).
- ``kv_event_stream`` — the JetStream stream of KV events, created on first use.
- ``jetstream_state``, ``jetstream_metrics`` — the JetStream state kvmesh keeps, created replicated,
  and how well it is replicated.
- ``nats_auth`` — NATS credentials and TLS, each from one named option.
- ``nats_server``, ``nats_cluster`` — an embedded NATS server, or a cluster of them.
- ``child_process`` — child processes that end with their parent.
- ``misconfiguration`` — misconfigurations found in the mesh, said loudly and once.
- ``metrics``, ``structured_logging``, ``heap``, ``ports``, ``run_file`` — Prometheus, structlog, the
  frozen start-up heap, free ports and process trees, ``kvmesh up``'s run file.
"""
