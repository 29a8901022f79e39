from kvmesh.worker.server import main

# guarded: vLLM starts its engine core with multiprocessing "spawn", which imports __main__ again
if __name__ == "__main__":
    main()
