from kvmesh.common.rpc.grpc_io import choose_grpc_io

choose_grpc_io()  # before the service imports gRPC, as the kvmesh command does (docs/decisions/0025)

from kvmesh.indexer.server import main  # noqa: E402

# guarded: vLLM starts its engine core with multiprocessing "spawn", which imports __main__ again
if __name__ == "__main__":
    main()
