"""Developer tools, not services: ``protogen`` regenerates the gRPC code (``kvmesh gen-protos``)."""
