from kvmesh.worker.server import main

main()
