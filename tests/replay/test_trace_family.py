"""The trace family's rules: each variant changes what its name says and keeps the rest."""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path

import pytest

from kvmesh.replay.trace_family import bursty_arrivals, longer_outputs, longer_prompts, main, write_variant

ROWS = [
    {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]},
    {"timestamp": 10, "input_length": 1500, "output_length": 7, "hash_ids": [0, 1, 2]},
    {"timestamp": 30, "input_length": 400, "output_length": 2, "hash_ids": [3]},
]


def test_longer_prompts_keep_who_shares_a_prefix_with_whom():
    rows = longer_prompts(ROWS, 2)
    assert [r["input_length"] for r in rows] == [2000, 3000, 800]
    assert rows[0]["hash_ids"] == [0, 1, 2, 3] and rows[1]["hash_ids"][:4] == rows[0]["hash_ids"]
    assert not set(rows[2]["hash_ids"]) & set(rows[1]["hash_ids"])  # an unshared prompt stays unshared
    assert [r["output_length"] for r in rows] == [5, 7, 2] and [r["timestamp"] for r in rows] == [0, 10, 30]


def test_longer_outputs_change_only_the_outputs():
    rows = longer_outputs(ROWS, 2)
    assert [r["output_length"] for r in rows] == [10, 14, 4]
    assert [{k: v for k, v in r.items() if k != "output_length"} for r in rows] == [
        {k: v for k, v in r.items() if k != "output_length"} for r in ROWS
    ]


def test_bursty_arrivals_keep_the_order_and_span_and_clump_the_gaps():
    rows = [{"timestamp": 100 * i, "input_length": 1, "output_length": 1, "hash_ids": [i]} for i in range(2000)]
    bursty = bursty_arrivals(rows, seed=3)
    assert [r["hash_ids"] for r in bursty] == [r["hash_ids"] for r in rows]
    assert bursty[0]["timestamp"] == 0 and abs(bursty[-1]["timestamp"] - rows[-1]["timestamp"]) <= 1
    gaps = [b["timestamp"] - a["timestamp"] for a, b in itertools.pairwise(bursty)]
    cv2 = statistics.pvariance(gaps) / statistics.mean(gaps) ** 2
    assert 3 < cv2 < 5  # drawn for 4; evenly spaced arrivals have 0
    assert bursty_arrivals(rows, seed=3) == bursty and bursty_arrivals(rows, seed=4) != bursty


def test_the_command_writes_each_variant_and_refuses_an_unknown_one(tmp_path: Path, capsys):
    source = tmp_path / "trace.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    assert main([str(source), str(tmp_path / "out")]) == 0
    written = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert written == ["bursty.jsonl", "outputs-2x.jsonl", "prompts-2x.jsonl", "prompts-4x.jsonl"]
    assert "mean prompt 3867 tokens" in capsys.readouterr().out  # prompts-4x: (1000 + 1500 + 400) × 4 / 3
    with pytest.raises(ValueError, match="unknown trace variant"):
        write_variant(source, "prompts-3x", tmp_path / "x.jsonl")
    assert main([str(tmp_path / "missing.jsonl"), str(tmp_path / "out")]) == 2
