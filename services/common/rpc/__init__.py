"""RPC plumbing: gRPC servers, channels, errors, and the long-lived streams the request path rides.

- ``grpc_server`` — a service's gRPC server (health, reflection, TLS) and ``channel_to``.
- ``channels`` — one channel per peer address, dropped when the peer leaves.
- ``grpc_errors`` — refusals and failures told apart (``kvmesh-origin``), errors from stream ends.
- ``status_error`` — one error type for "this call fails with this gRPC status".
- ``grpc_io``, ``grpc_tls``, ``grpc_streams`` — gRPC core's I/O choice, TLS credentials, stream helpers.
- ``query_streams`` — request/answer calls over one stream per peer (``RouteMany``, ``FindMatchesMany``).
- ``stream_sessions`` — a caller's ``Worker.GenerateMany`` stream per worker, forwards claimed from it.
- ``multiplexed`` — the worker's side of ``GenerateMany`` (many requests, attached callers, forwards).
- ``message_builder``, ``batch_queue``, ``tasks`` — the next message built in place; a queue taken whole;
  background tasks cancelled and awaited.
"""
