"""``kvmesh bench``: a live load generator for any OpenAI-compatible endpoint.

- ``cli`` — the command: a trace or a shared-prefix workload, at a rate or a concurrency.
- ``workload`` — what it sends: prompts from a Mooncake trace, or a synthetic shared-prefix set.
- ``session_turns`` — a session's turns in order, each finding the previous reply where it was made.
- ``runner`` — sends it, streaming, and times every token.
- ``report`` — the JSON report and its plots.
- ``run_comparison`` — how far apart two setups' repeated runs are: a bootstrap interval for a difference.
"""
