from kvmesh.router.server import main

main()
