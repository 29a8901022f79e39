"""Which of gRPC core's two I/O layers a kvmesh process uses; chosen before gRPC is loaded.

gRPC core 1.85 does its socket work either in its EventEngine (the default) or in its older iomgr
pollers; the experiments ``event_engine_client`` and ``event_engine_listener`` pick between them for
client channels and servers. On kvmesh's serving path (long-lived streams, one small message per
request and hop, under uvloop) iomgr costs less CPU per message: decision 25 has the measurements.
gRPC reads ``GRPC_EXPERIMENTS`` once, when it is first loaded, so the ``kvmesh`` command sets it
before it imports any service.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

IO_ENV = "KVMESH_GRPC_IO"
IO_CHOICES = ("iomgr", "event-engine")
DEFAULT_IO = "iomgr"
# gRPC's own switch: a comma-separated list of experiments, "-name" turns one off
GRPC_EXPERIMENTS_ENV = "GRPC_EXPERIMENTS"
IOMGR_EXPERIMENTS = "-event_engine_client,-event_engine_listener"


def choose_grpc_io(environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Set ``GRPC_EXPERIMENTS`` for the I/O layer ``$KVMESH_GRPC_IO`` names (default ``iomgr``) and
    return the value set; None where nothing is set: ``event-engine`` (gRPC's default), or
    ``GRPC_EXPERIMENTS`` already given (the user's own choice wins). Child processes inherit it.

    Raises SystemExit for an unknown ``$KVMESH_GRPC_IO``. Where gRPC is already loaded in this
    process the setting still reaches the processes it starts, but not this one."""
    wanted = environ.get(IO_ENV, DEFAULT_IO)
    if wanted not in IO_CHOICES:
        raise SystemExit(f"{IO_ENV} must be one of {', '.join(IO_CHOICES)}, not {wanted!r}")
    if wanted == "event-engine" or GRPC_EXPERIMENTS_ENV in environ:
        return None
    environ[GRPC_EXPERIMENTS_ENV] = IOMGR_EXPERIMENTS
    return IOMGR_EXPERIMENTS
