"""`python -m services <command>`: the same as the `kvmesh` console script."""

from services.cli import main

main()
