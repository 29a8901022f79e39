"""``python -m kvmesh.up`` runs ``kvmesh up``."""

from kvmesh.up import main

main()
