"""What happens to the mesh when a host, a link or a NATS node goes away? Runs the failure drills
(kvmesh.devtools.drills) on a mesh over test hosts (network namespaces: needs root), each drill
``--runs`` times, and prints one line per run: requests, failures through the frontends that stayed
up, requests in flight on a frontend that went down with its host, requests past their deadline,
how long discovery took to drop and take back the host's instances, time to recover, convergence of
every indexer replica, and whether a new indexer replica restored from the snapshot.

    sudo python -m bench.drills [--drills kill-host partition kill-stream-leader rolling-nats] [--runs 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from kvmesh.common.runtime.structured_logging import configure_logging
from kvmesh.devtools.drills import DRILLS, DrillReport, run_drill
from kvmesh.devtools.host_mesh import HostMesh, HostMeshLayout
from kvmesh.devtools.test_hosts import TestHosts, usable

CLIENT = "client"


def targets(drill: str, runs: int, layout: HostMeshLayout) -> list[str]:
    """The host each run strikes: first one without a frontend, then one with (its in-flight requests
    are lost with it and counted apart)."""
    plain = [h for h in layout.mesh_hosts if h not in layout.frontend_hosts]
    order = [*plain, *layout.frontend_hosts] or list(layout.mesh_hosts)
    return [order[i % len(order)] for i in range(runs)]


def run(drills: list[str], runs: int, layout: HostMeshLayout, workdir: Path, partition_s: float) -> list[DrillReport]:
    reports = []
    with TestHosts([*layout.mesh_hosts, CLIENT]) as hosts:
        mesh = HostMesh(hosts, workdir, layout)
        mesh.start()
        hosts.in_namespace(CLIENT, mesh.wait_ready)
        for drill in drills:
            for i, target in enumerate(targets(drill, runs, layout), start=1):
                report = hosts.in_namespace(
                    CLIENT, lambda d=drill, i=i, t=target: run_drill(mesh, d, i, t, partition_s=partition_s)
                )
                print(line(report), flush=True)
                reports.append(report)
    return reports


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def line(r: DrillReport) -> str:
    return (
        f"{r.drill:<19} run {r.run} on {r.target}: {r.requests} requests, {r.failed} failed, "
        f"{r.lost_with_frontend} lost with their frontend, {r.hung} past deadline; discovery drop "
        f"{seconds(r.discovery_drop_s)} s, back {seconds(r.discovery_return_s)} s; recovered in "
        f"{seconds(r.recover_s)} s, converged {'yes' if r.converged else 'NO'}, snapshot restore "
        f"{'yes' if r.snapshot_restore else 'NO'}" + (f"; errors: {r.errors[:3]}" if r.errors else "")
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drills", nargs="+", choices=DRILLS, default=list(DRILLS))
    parser.add_argument("--runs", type=int, default=2, help="runs of each drill")
    parser.add_argument("--workers-per-host", type=int, default=2)
    parser.add_argument("--partition-secs", type=float, default=20.0, help="how long a cut link stays cut")
    parser.add_argument("--json", type=Path, help="also write the reports here")
    parser.add_argument("--keep-logs", action="store_true", help="keep the services' logs (the folder is printed)")
    args = parser.parse_args(argv)
    configure_logging("warning", service="drills")
    why_not = usable()
    if why_not:
        print(f"cannot run the drills here: {why_not}", file=sys.stderr)
        return 2
    layout = HostMeshLayout(workers_per_host=args.workers_per_host)
    workdir = Path(tempfile.mkdtemp(prefix="kvmesh-drills-"))
    reports = run(args.drills, args.runs, layout, workdir, args.partition_secs)
    if args.json:
        args.json.write_text(json.dumps([r.as_dict() for r in reports], indent=2))
    print(f"logs: {workdir}" if args.keep_logs else "", end="")
    if not args.keep_logs:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if all(r.ok() for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
