"""The request path as a caller walks it (the frontend, ``kvmesh.client``).

- ``request_path`` — route, stream from the worker, report, migrate, fail over: one place.
- ``router_client`` — the router replicas, each over one ``RouteMany`` stream.
"""
