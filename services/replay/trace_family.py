"""A family of traces derived from the shared Mooncake trace by written rules and a seed, for
trying the planner on traffic it was not tuned on. Each variant changes one thing:

- ``prompts-2x``, ``prompts-4x``: every prompt k times longer, its prefix structure kept. Each
  512-token block becomes k blocks (hash id h becomes h·k … h·k + k − 1) and ``input_length`` is
  multiplied by k: requests that shared a prefix of m blocks share one of m·k, and a conversation's
  growing history grows k times as fast (longer, conversation-shaped prompts).
- ``outputs-2x``: every ``output_length`` doubled.
- ``bursty``: the same requests in the same order over the same span, their gaps redrawn from a gamma
  distribution with the trace's mean gap and a squared coefficient of variation of 4 (Poisson
  arrivals have 1): arrivals come in clumps with quiet stretches between (the ``seed`` draws them).

The arrival profile (crest first or trough first) is the replay's ``--arrival-profile``, not part of
the trace. Writes each variant as JSONL in the shared trace's format:

    python -m kvmesh.replay.trace_family ../shared/data/mooncake_synthetic_trace.jsonl /tmp/traces --seed 0
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable
from pathlib import Path

Row = dict  # one request as the trace's JSON object
BURSTY_CV2 = 4.0


def longer_prompts(rows: list[Row], factor: int) -> list[Row]:
    """Every prompt ``factor`` times longer, each block split into ``factor`` (see the module)."""
    return [
        {
            **row,
            "input_length": row["input_length"] * factor,
            "hash_ids": [h * factor + j for h in row["hash_ids"] for j in range(factor)],
        }
        for row in rows
    ]


def longer_outputs(rows: list[Row], factor: int) -> list[Row]:
    return [{**row, "output_length": row["output_length"] * factor} for row in rows]


def bursty_arrivals(rows: list[Row], seed: int, cv2: float = BURSTY_CV2) -> list[Row]:
    """The same requests in the same order over the same span, gaps gamma-distributed with the same
    mean and squared coefficient of variation ``cv2`` (whole milliseconds)."""
    ordered = sorted(rows, key=lambda r: r["timestamp"])
    start, span = ordered[0]["timestamp"], ordered[-1]["timestamp"] - ordered[0]["timestamp"]
    rng = random.Random(seed)
    gaps = [rng.gammavariate(1 / cv2, cv2) for _ in ordered[1:]]
    scale = span / sum(gaps) if gaps and sum(gaps) > 0 else 0.0
    result, clock = [], float(start)
    for i, row in enumerate(ordered):
        if i:
            clock += gaps[i - 1] * scale
        result.append({**row, "timestamp": round(clock)})
    return result


VARIANTS: dict[str, Callable[[list[Row], int], list[Row]]] = {
    "prompts-2x": lambda rows, _seed: longer_prompts(rows, 2),
    "prompts-4x": lambda rows, _seed: longer_prompts(rows, 4),
    "outputs-2x": lambda rows, _seed: longer_outputs(rows, 2),
    "bursty": bursty_arrivals,
}


def read_rows(path: Path) -> list[Row]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_variant(source: Path, variant: str, out: Path, seed: int = 0) -> Path:
    """Writes ``variant`` of ``source`` to ``out`` (JSONL); ValueError for an unknown variant."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown trace variant {variant!r} (one of {', '.join(VARIANTS)})")
    rows = VARIANTS[variant](read_rows(source), seed)
    out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return out


def main(argv: list[str] | None = None) -> int:
    # the module's rules are the help: which variant changes what, and how
    parser = argparse.ArgumentParser(
        prog="python -m kvmesh.replay.trace_family",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("source", type=Path, help="the trace to derive from (JSONL, the shared trace's format)")
    parser.add_argument("out_dir", type=Path, help="where the variants go, one <variant>.jsonl each")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--seed", type=int, default=0, help="draws the bursty variant's gaps")
    args = parser.parse_args(argv)
    if not args.source.is_file():
        print(f"error: no trace at {args.source}", file=sys.stderr)
        return 2
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for variant in args.variants:
        path = write_variant(args.source, variant, args.out_dir / f"{variant}.jsonl", args.seed)
        rows = read_rows(path)
        mean_in = sum(r["input_length"] for r in rows) / len(rows)
        mean_out = sum(r["output_length"] for r in rows) / len(rows)
        print(f"{path}: {len(rows)} requests, mean prompt {mean_in:.0f} tokens, mean output {mean_out:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
