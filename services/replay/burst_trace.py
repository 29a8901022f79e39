"""A burst trace derived from the shared Mooncake trace: every request of two or more blocks comes
with siblings, requests that share all of its prompt but the last block (a new tail each) and arrive
within ``--spread-ms`` of it, as fan-out agents and parallel samples of one conversation do. Writes
the trace as JSONL (the shared trace's format) and prints what it holds.

    python -m kvmesh.replay.burst_trace ../shared/data/mooncake_synthetic_trace.jsonl /tmp/burst.jsonl
    kvmesh replay /tmp/burst.jsonl --arrival-speedup-ratio 4 ...
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path


def burst_trace(source: Path, out: Path, max_siblings: int = 4, spread_ms: int = 5, seed: int = 0) -> dict[str, float]:
    """Writes the burst trace of ``source`` to ``out``: each request of two blocks or more followed by
    1 to ``max_siblings - 1`` siblings (drawn evenly), each at a random whole millisecond within
    ``spread_ms`` after it, with the request's hash ids but a new last one. Returns its figures."""
    rows = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    next_id = max(max(r["hash_ids"], default=0) for r in rows) + 1
    rng = random.Random(seed)
    lines = []
    groups = 0
    for row in rows:
        lines.append(row)
        if len(row["hash_ids"]) < 2:
            continue
        groups += 1
        for _ in range(rng.randint(1, max_siblings - 1)):
            sibling = dict(row)
            sibling["timestamp"] = row["timestamp"] + rng.randint(0, spread_ms)
            sibling["hash_ids"] = [*row["hash_ids"][:-1], next_id]
            next_id += 1
            lines.append(sibling)
    lines.sort(key=lambda r: r["timestamp"])  # stable: a sibling at the same millisecond stays after
    with out.open("w") as file:
        for line in lines:
            file.write(json.dumps(line) + "\n")
    return {"requests": len(lines), "source_requests": len(rows), "groups": groups}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="a Mooncake-format trace (JSONL)")
    parser.add_argument("out", type=Path, help="where to write the burst trace")
    parser.add_argument("--max-siblings", type=int, default=4, help="most requests in a group, the original included")
    parser.add_argument("--spread-ms", type=int, default=5, help="siblings arrive within this after the original")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.max_siblings < 2 or args.spread_ms < 0:
        parser.error("--max-siblings must be at least 2 and --spread-ms at least 0")
    print(json.dumps(burst_trace(args.source, args.out, args.max_siblings, args.spread_ms, args.seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
