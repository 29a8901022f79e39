from kvmesh.indexer.server import main

main()
