"""``kvmesh replay``: the router's routing pipeline, the prefix index and the mock engine driven in
virtual time.

- ``cli`` — the command: a JSON summary, a CSV per request, the planner's timeline.
- ``simulator`` — the event loop: arrivals, steps, KV transfers, the router queue, the planner.
- ``queue_door`` — the router queue at the door: route now, wait, or be refused.
- ``virtual_index`` — what the indexer replicas would answer, events delayed as on a live mesh.
- ``fleet`` — the replay's discovery and its virtual connector: workers that join, drain, stop.
- ``elastic`` — the planner's ticks and the virtual fleet's changes, as a part of the simulator.
- ``handoff`` — a shrink that hands its cache on: whom to remove, what it sends, to whom.
- ``fleet_search`` — the smallest fixed fleet reaching an SLA goal, and a planner capped at one.
- ``config`` — its options (the router's and the planner's included) and its per-request record.
- ``report`` — the summary figures.
- ``bounds`` — the most any router could reuse on a trace: one fleet-sized LRU cache, an infinite one.
- ``mooncake_trace`` — Mooncake-format traces and the prompts they stand for.
- ``arrival_profile`` — a trace's arrival rate reshaped over time.
- ``burst_trace``, ``trace_family`` — traces derived from the shared one by written rules.
- ``session_trace`` — session-structured traces (chats, agent loops, tenants) by written rules.
- ``replies`` — each turn's reply cached on the worker that made it (``--cache-replies``).
"""
