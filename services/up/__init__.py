"""``kvmesh up``: a whole working mesh on one machine, one process per service.

Starts an embedded NATS server (or uses ``--nats-url``), the indexer replicas, the router, the mock
workers and the frontend; waits until every one has registered and the HTTP API answers; says where
to send requests. A service that crashes is restarted (at most five restarts a minute, then the mesh
stops). Ctrl-C or SIGTERM stops every child (SIGTERM, then SIGKILL after a grace period),
and the children are also tied to this process's life by the kernel (``PR_SET_PDEATHSIG``), so even
a ``kill -9`` of ``kvmesh up`` leaves no orphans.

The test harness that runs ``kvmesh up`` as a child process is ``kvmesh.devtools.mesh_process``.

- ``config`` — ``UpConfig``: its own options and the services' option groups it takes.
- ``processes`` — one process per service, with its flags.
- ``planner_pools`` — ``--planner``: the planner and the pools it resizes.
- ``departures`` — which workers a shrink stops first (``--shrink-handoff-blocks``).
- ``supervisor`` — start, wait, restart, stop.
"""

from kvmesh.up.supervisor import main

__all__ = ["main"]
