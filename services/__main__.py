"""`python -m kvmesh <command>`: the same as the `kvmesh` console script."""

from kvmesh.cli import main

# guarded: vLLM starts its engine core with multiprocessing "spawn", which imports __main__ again
if __name__ == "__main__":
    main()
