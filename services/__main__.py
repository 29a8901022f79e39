"""`python -m kvmesh <command>`: the same as the `kvmesh` console script."""

from kvmesh.cli import main

main()
