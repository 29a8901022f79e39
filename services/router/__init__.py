"""Router replicas: the routing pipeline (sans-I/O core) behind ``kvmesh.v1.Router``.

The pipeline (``routing`` strings its stages together; ``kvmesh replay`` drives the same objects):

- ``routing`` — the ``Router``: prepare, the cache view, decide or place, the load picture.
- ``candidates`` — the request as routing reads it, and the workers that may take it.
- ``eligibility`` — the rules: model, adapter, role, block size, recent failure, busy.
- ``cache_view`` — what each worker holds of a prompt: the index's answer, tier credits, predictions.
- ``predicted_blocks``, ``approximate_index`` — predict-on-route; approximate mode's memory.
- ``session_affinity`` — a session's turns prefer its last turn's worker, softly and for a while.
- ``loop_turns`` — an anonymous loop's next step, told by its prompt (the duplicate penalty spares it).
- ``choice`` — the cost and the choice: policies per block size and mode, fitted step times.
- ``step_times`` — the step times each worker is costed with: its model's workers' steps pooled.
- ``policy`` — one routing mode's choice (kv, round-robin, random, power-of-two, cache-aware).
- ``scheduler`` — the KV cost models and the simple selectors.
- ``cache_aware`` — SGLang's cache-aware policy.
- ``prefix_pull`` — a saturated holder's prefix pulled over the KV transfer, priced beside the rest.
- ``prefill_placement`` — where a split request prefills, and whether a split pays.
- ``split_overhead`` — what a split adds to time to first token, measured.
- ``load_picture`` — admission (busy thresholds) and the load it leaves behind.
- ``load_tracker``, ``active_sequences`` — each worker's predicted load through a request's life.
- ``decode_pace`` — each worker's measured inter-token latency, lately: new sessions avoid one behind.

The service around it:

- ``server`` — ``kvmesh router``: discovery, the indexer client, replica sync, the servicer.
- ``servicer`` — ``RouteMany`` and ``Route``: plan, count, forward.
- ``forwards`` — requests forwarded to their workers, answered only if that fails.
- ``disaggregation``, ``prefill_job`` — a split request's prefill half, run by the router.
- ``request_queue`` — where requests wait while every worker is busy, by priority class.
- ``indexer_client`` — the indexer replicas' answers over one stream each.
- ``replica_sync``, ``sync_messages`` — the load picture shared with the other replicas.
- ``report_listener`` — the frontends' first-token and end reports.
- ``load_reports`` — per-worker loads published for the planner.
- ``fleet_checks`` — a misconfigured fleet, said once.
- ``config``, ``metrics``, ``outcomes`` — options; Prometheus metrics; recent outcomes.
"""
