"""Sans-I/O logic more than one service runs (plain classes, time passed in).

- ``prefix_index`` — the global prefix index (indexer replicas, approximate mode, the replay).
- ``worker_blocks`` — one worker's blocks in the index and the bookkeeping that is its alone.
- ``worker_state`` — a worker's whole state moved in and out (snapshots, gap recovery).
- ``index_answer`` — what the index answers for one query, per worker and tier.
- ``tier_credits`` — offloaded blocks by tier, and what each tier is worth to routing.
- ``timing``, ``timing_fit`` — the engine step-time model and its fit from measured steps.
- ``fleet_timing`` — one step-time model for like workers' steps together, scaled to each one's speed.
- ``engine_profile`` — a measured engine profile for the planner.
- ``stats`` — small statistics shared by the replay's report and the planner.
- ``tiny_model`` — where the bundled ``kvmesh-tiny`` tokenizer lives.
"""
