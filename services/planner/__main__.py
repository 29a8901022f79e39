"""``python -m kvmesh.planner`` runs the planner service (``kvmesh planner run``)."""

from kvmesh.common.rpc.grpc_io import choose_grpc_io

choose_grpc_io()  # before the planner imports gRPC, as the kvmesh command does (docs/decisions/0025)

from kvmesh.planner.cli import main  # noqa: E402

if __name__ == "__main__":
    main(["run", *__import__("sys").argv[1:]])
