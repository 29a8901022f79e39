"""``python -m kvmesh.planner`` runs the planner service (``kvmesh planner run``)."""

from kvmesh.planner.cli import main

if __name__ == "__main__":
    main(["run", *__import__("sys").argv[1:]])
