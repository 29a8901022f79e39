"""Developer tools, not services.

- ``protogen`` — ``kvmesh gen-protos``: the Python gRPC code regenerated from ``protos/``.
- ``mesh_process`` — ``kvmesh up`` as a child process, for tests and benchmarks.
- ``test_hosts`` — network namespaces joined by a bridge: several hosts on one machine.
- ``host_mesh`` — a mesh laid over test hosts, as over machines.
- ``drills`` — failure drills on such a mesh, under streaming load.
- ``index_truth`` — does an indexer replica hold exactly what the workers hold? (also a command that
  waits until every replica does, run in a process of its own from a test host)
"""
