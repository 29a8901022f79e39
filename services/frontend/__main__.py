from kvmesh.frontend.server import main

main()
