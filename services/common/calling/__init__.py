"""The request path as a caller walks it (the frontend, ``kvmesh.client``), and what a caller asks
the workers about their caches.

- ``request_path`` — route, stream from the worker, report, migrate, fail over: one place.
- ``router_client`` — the router replicas, each over one ``RouteMany`` stream.
- ``worker_caches`` — what each worker's cache holds, and what each one's departure would lose.
"""
