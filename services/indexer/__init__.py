"""Indexer replicas: the prefix index (sans-I/O core) fed from the JetStream event stream.

- ``server`` — ``kvmesh indexer``: the index answering ``kvmesh.v1.Indexer``, and what runs around it.
- ``consumer`` — the durable pull consumer that applies the stream's events in order.
- ``standing_pull`` — following a durable pull consumer with standing pull requests.
- ``recovery`` — a gap in a worker's event ids: ask the worker for its state.
- ``snapshot`` — index snapshots in the object store, one replica at a time.
- ``snapshot_lock`` — the lease lock that makes it one replica at a time.
- ``purge`` — the events a snapshot covers, purged once every replica's durable acknowledged them.
- ``config``, ``metrics`` — the indexer's options; its Prometheus metrics.
"""
