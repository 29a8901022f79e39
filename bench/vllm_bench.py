"""KV-aware routing in front of real engines: 3 vLLM workers (CPU build, the tiny random-weight
Llama) with capped caches, a window of the shared Mooncake trace replayed live, routed ``kv``,
``round-robin`` and ``cache-aware``.

The trace window (``--trace-start``, ``--trace-requests``; by default requests 3600-3899, where
the trace reuses most) keeps its arrival times and its prefix structure: each of its 512-token
hash ids becomes ``--trace-block-size`` (32) token ids, one vLLM block, so a prompt shares exactly
the blocks its trace request shares. Each worker's cache is capped (``--num-gpu-blocks``, 1,024
blocks) below the window's distinct blocks divided by the workers, so no worker can hold every
prefix group and where a request goes decides what it finds. Each setup is a fresh ``kvmesh up
--engine vllm --workers 3`` (no setup inherits another's caches) whose workers each serve a few
prompts of the window's lengths before the window (vLLM's CPU build is slow on a worker's first
requests; see ``warm_up``). Printed per setup: the fraction of
prompt tokens vLLM served from its prefix cache (``usage.prompt_tokens_details``), TTFT p50/p99,
requests/s and output tokens/s, the same per serving worker (requests, cached share, TTFT p50), the
requests the router moved off a stalled worker or one whose decodes were behind (its
``kvmesh_router_steered_total``, decisions 63 and 67), and kv's TTFT p50 against round-robin's; above
the table, the cached share any router could reach on the window (:func:`window_bounds`); the
TTFT distributions are
plotted together (``--output-dir``/compare_cdf.png).
``--repeats N`` runs every setup N times, the order rotated each time, and pools each setup's requests
(one run's p99 is its third-slowest request, and on 2 shared cores it moves by tens of percent from
run to run); the table then also shows each run's own TTFT p50 and p99, and kv's pooled cached share, TTFT
p50 and p99 minus cache-aware's and round-robin's, each with a 95% interval that resamples the runs
and then their requests (:mod:`kvmesh.loadgen.run_comparison`): an interval holding 0 says these runs
cannot tell the two setups apart on that figure.
``kv`` routes with the router's defaults (since decision 54, ``--kv-duplicate-penalty 128``);
``--kv-duplicate-penalty P`` adds a fourth setup, ``kv-penalty``: kv with that duplicate penalty
(``0``: plain ``kv``, the default before decision 54).

``--part disagg`` compares 1 aggregated vLLM worker with 1 prefill + 1 decode worker (KV over vLLM's
NIXL connector), splitting every request (``--disagg-split-when always``) and by default (only
where a split is predicted to pay), on distinct prompts sent one at a time: TTFT, and the KV bytes
and blocks each request moved (from the router's counters).

``--setups`` runs only some of the three (kv always), for more repeats of a comparison in the same time.
``--model-shape small`` serves a wider, deeper random-weight Llama (``kvmesh build-tiny-model --shape small``):
the tiny one computes a prompt in about what the serving path adds to a first token, so a cache hit saves
little beside it; the small one's prefill costs several times the path, as a real model's does on its
accelerator (docs/decisions/0074). Run it at the trace's own rate: it needs about five times the CPU a token.
``--cache-replies`` (a session trace, ``kvmesh.replay.session_trace``): each turn is sent after its
session's previous answer, and that answer's reply blocks are first prefilled on the worker that
served it, where a real reply's KV would be (docs/decisions/0075).

    python -m bench.vllm_bench [--part routing|disagg|all] [--trace PATH] [--workers 3] [--repeats 1]
        [--setups kv cache-aware] [--model-shape small]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from statistics import mean

import httpx

from bench.live_load import run_load
from kvmesh.devtools.mesh_process import MeshProcess
from kvmesh.loadgen.run_comparison import differences
from kvmesh.loadgen.workload import as_sent
from kvmesh.replay.bounds import ReuseBounds, reuse_bounds
from kvmesh.replay.mooncake_trace import read_trace
from kvmesh.replay.report import percentile
from kvmesh.worker.engines.vllm import tiny_llama
from tests.support import discovered, scrape

ENGINE_ARGS = ["--block-size", "32", "--max-model-len", "2048", "--gpu-memory-utilization", "0.5", "--enforce-eager"]
SHARED_TRACE = Path(__file__).resolve().parents[2] / "shared" / "data" / "mooncake_synthetic_trace.jsonl"
MODES = ("kv", "round-robin", "cache-aware")
PENALISED = "kv-penalty"  # the fourth setup, with --kv-duplicate-penalty
CONTEXT = 8192  # the tiny model's positions


def trace_window(path: Path, start: int, count: int, block_tokens: int, into: Path) -> tuple[Path, int]:
    """Requests ``start`` .. ``start + count - 1`` of a Mooncake trace, their timestamps from 0,
    without those whose prompt (``block_tokens`` per hash id) would not fit the model's context;
    the file and how many were left out."""
    rows = [json.loads(line) for line in path.read_text().splitlines()[start : start + count]]
    first = rows[0]["timestamp"]
    fits = [row for row in rows if len(row["hash_ids"]) * block_tokens + 64 <= CONTEXT]
    into.write_text("".join(json.dumps({**row, "timestamp": row["timestamp"] - first}) + "\n" for row in fits))
    return into, len(rows) - len(fits)


# Prompt lengths (tokens, about) each worker serves before a routing setup's window, and how many at
# once: vLLM's CPU build is slow on the first requests each worker serves (14-32 s TTFTs in the
# first 20 s of every setup, seen 2026-11-29 before this warm-up), and a policy that sends its first
# requests to few workers would meet that cost later, inside the window, than one that spreads them.
WARM_UP_TOKENS = (64, 512, 2048, 6144)
WARM_UP_BATCH = 4


def window_bounds(window: Path, args: argparse.Namespace) -> ReuseBounds:
    """What any router could keep of the window's prompt tokens as they are sent (every block kept;
    one LRU cache of the fleet's blocks), replies cached where they were made with ``--cache-replies``:
    a cached share read beside it says how much placement could still win."""
    sent = as_sent(read_trace(window), args.trace_block_size)
    capacity = args.workers * args.num_gpu_blocks
    return reuse_bounds(sent, args.trace_block_size, args.trace_block_size, capacity, args.cache_replies)


def warm_up(mesh: MeshProcess, model: str = "kvmesh-tiny") -> None:
    """Each worker serves prompts of ``WARM_UP_TOKENS``, one at a time, then ``WARM_UP_BATCH`` at once,
    named to it (``kvmesh.worker_id``), all workers together. The prompts are random letters, so
    they share no prefix with the window or each other beyond a token or two."""
    rng = random.Random(0)
    prompts = {
        # a spaced letter is two of the tiny model's tokens
        record.instance_id: [" ".join(rng.choice("bcdfghjkmnpqrstvwxz") for _ in range(n // 2)) for n in WARM_UP_TOKENS]
        for record in discovered(mesh.nats_url, "worker")
    }

    def send(worker_id: int, prompt: str) -> None:
        body = {"model": model, "prompt": prompt, "max_tokens": 4, "kvmesh": {"worker_id": worker_id}}
        response = httpx.post(f"{mesh.api}/completions", json=body, timeout=600)
        if response.is_error:  # the mesh's own words, not only the status
            raise RuntimeError(f"warm-up request to worker {worker_id}: {response.status_code} {response.text}")

    def one_worker(worker_id: int) -> None:
        for prompt in prompts[worker_id]:
            send(worker_id, prompt)
        with ThreadPoolExecutor(WARM_UP_BATCH) as batch:
            list(batch.map(lambda prompt: send(worker_id, prompt + " z"), prompts[worker_id][:WARM_UP_BATCH]))

    with ThreadPoolExecutor(len(prompts)) as workers:
        list(workers.map(one_worker, prompts))


def router_args(setup: str, args: argparse.Namespace) -> list[str]:
    """The router options of a setup: a mode of MODES, or kv with the duplicate penalty."""
    if setup == PENALISED:
        return ["--router-mode", "kv", "--kv-duplicate-penalty", str(args.kv_duplicate_penalty)]
    return ["--router-mode", setup]


def model_args(shape: str) -> list[str]:
    """The workers' ``--model`` for a shape of :data:`~kvmesh.worker.engines.vllm.tiny_llama.SHAPES`, built
    on first use; none for the tiny shape, which a worker given no model builds itself."""
    if shape == tiny_llama.DEFAULT_SHAPE:
        return []
    return ["--model", str(tiny_llama.ensure(shape=shape))]


def run_setup(mode: str, trace: Path, args: argparse.Namespace, report_dir: Path) -> dict:
    """One run of a setup on a fresh mesh; its ``kvmesh bench`` report (kept in ``report_dir``) with
    the requests the router's rules moved (``steered``)."""
    engine = [
        "--block-size", str(args.trace_block_size), "--num-gpu-blocks-override", str(args.num_gpu_blocks),
        "--max-model-len", str(CONTEXT), "--kv-cache-memory-bytes", str(256 << 20), "--enforce-eager",
        "--dtype", "float32", *model_args(args.model_shape),
    ]  # fmt: skip
    mesh = MeshProcess(
        "--engine", "vllm", "--workers", str(args.workers), *router_args(mode, args), "--log-level", "warning", *engine
    ).start(timeout=600)
    try:
        warm_up(mesh)
        report = run_load(
            mesh.api,
            mode,
            "--endpoint",
            "completions",
            "--trace",
            str(trace),
            "--trace-block-size",
            str(args.trace_block_size),
            "--arrival-speedup-ratio",
            str(args.arrival_speedup_ratio),
            "--max-output-tokens",
            str(args.output_tokens),
            *(["--cache-replies"] if args.cache_replies else []),
            out_dir=report_dir,
        )
        # requests decisions 63 and 67 moved off the worker the cost rated cheapest (a stalled worker,
        # decodes behind the ITL target): whether those rules fired in the run
        steered = router_metrics(mesh).get("kvmesh_router_steered_total", [])
        report["steered"] = {labels["rule"]: count for labels, count in steered}
        return report
    finally:
        mesh.stop()


def run_repeats(setups: list[str], trace: Path, args: argparse.Namespace, out_dir: Path) -> dict[str, list[dict]]:
    """Every setup ``args.repeats`` times; a run's report in ``out_dir``/setup (one repeat) or
    ``out_dir``/setup/run-R. Repeat R starts at setup R (the order rotated), so that the machine
    drifting over the hour does not always fall on the same setup."""
    runs: dict[str, list[dict]] = {setup: [] for setup in setups}
    for repeat in range(args.repeats):
        turn = repeat % len(setups)
        for setup in setups[turn:] + setups[:turn]:
            report_dir = out_dir / setup if args.repeats == 1 else out_dir / setup / f"run-{repeat}"
            runs[setup].append(run_setup(setup, trace, args, report_dir))
    return runs


def pooled(label: str, reports: list[dict]) -> dict:
    """One report of a setup's runs: their requests together (the cached share over all their prompt
    tokens, TTFT percentiles over all their first tokens), requests/s and output tokens/s the runs'
    mean, the rules' moves summed. Pooled rather than a median of the runs' own figures because a
    300-request run's p99 is its third-slowest request, which moved by 40% between two runs of one
    setup on these 2 cores (seen 2026-12-03); three runs pooled put the p99 on nine."""
    if len(reports) == 1:
        return reports[0]
    rows = [row for report in reports for row in report["per_request"]]
    done = [row for row in rows if row["error"] is None]
    prompt = sum(row["prompt_tokens"] for row in done)
    ttft = [row["ttft_s"] for row in done if row["ttft_s"] is not None]
    steered: dict[str, float] = {}
    for report in reports:
        for rule, count in report.get("steered", {}).items():
            steered[rule] = steered.get(rule, 0) + count
    return {
        "label": label,
        "completed": len(done),
        "cached_token_ratio": sum(row["cached_tokens"] for row in done) / prompt if prompt else 0.0,
        "ttft_ms": {"p50": percentile(ttft, 50) * 1000, "p99": percentile(ttft, 99) * 1000},
        "request_throughput_per_s": mean(report["request_throughput_per_s"] for report in reports),
        "output_tokens_per_s": mean(report["output_tokens_per_s"] for report in reports),
        "steered": steered,
        "per_request": rows,
    }


def run_spread(reports: list[dict]) -> str:
    """The runs' own TTFT p50s and p99s (ms), in the order they ran, so a reader sees how far one
    run is from another beside the pooled figures."""
    p50 = "/".join(f"{report['ttft_ms']['p50']:.0f}" for report in reports)
    p99 = "/".join(f"{report['ttft_ms']['p99']:.0f}" for report in reports)
    return f"p50 {p50}, p99 {p99}"


def per_worker(report: dict) -> list[str]:
    """Per serving worker (the report's ``worker_id``): requests, cached share of its prompt tokens,
    TTFT p50. Why: on 2 cores three engines do not run equally fast (seen 2026-11-29: under
    round-robin one worker's TTFT p50 was 25× another's), and where each policy put its load reads
    only per worker."""
    served: dict[str, list[dict]] = {}
    for row in report["per_request"]:
        if row["error"] is None and row["ttft_s"] is not None:
            served.setdefault(row["worker_id"] or "?", []).append(row)
    lines = []
    for worker, done in sorted(served.items(), key=lambda item: -len(item[1])):
        prompt = sum(row["prompt_tokens"] for row in done) or 1
        ttft = sorted(row["ttft_s"] for row in done)[len(done) // 2]
        cached = sum(row["cached_tokens"] for row in done) / prompt
        lines.append(f"…{worker[-4:]} {len(done)} {cached:.3f} {ttft * 1000:.0f} ms")
    return lines


def router_metrics(mesh: MeshProcess) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The mesh's router's metric samples by name, each with its labels (:func:`tests.support.scrape`)."""
    (router,) = discovered(mesh.nats_url, "router")
    return scrape(router.extra["metrics"])


def disagg_part(args: argparse.Namespace) -> None:
    split = ["--workers", "1", "--prefill-workers", "1", "--disagg-min-uncached-tokens", "0"]
    setups = [
        ("1 aggregated", ["--workers", "1"]),
        ("1+1, split always", [*split, "--disagg-split-when", "always"]),
        ("1+1, split on gain", split),  # the default: a split only where it is predicted to pay
    ]
    requests = args.disagg_requests
    rows = []
    for label, setup in setups:
        mesh = MeshProcess("--engine", "vllm", "--log-level", "warning", *setup, *ENGINE_ARGS).start(timeout=600)
        try:
            report = run_load(
                mesh.api,
                label,
                "--endpoint",
                "completions",
                "--num-requests",
                str(requests),
                "--num-prefixes",
                str(requests),  # every prompt distinct: every one prefills in full
                "--prefix-tokens",
                str(args.prefix_tokens),
                "--suffix-tokens",
                "16",
                "--output-tokens",
                str(args.output_tokens),
                "--concurrency",
                "1",
            )
            page = router_metrics(mesh)
            moved = sum(value for _, value in page.get("kvmesh_router_kv_transfer_bytes_total", []))
            prefills = page.get("kvmesh_router_prefills_total", [])
            counters = {"moved": moved, "remote": sum(n for labels, n in prefills if labels["where"] == "remote")}
        finally:
            mesh.stop()
        rows.append((label, report, counters))
    print(f"\n{requests} distinct prompts of ~{args.prefix_tokens} tokens, one at a time, {args.output_tokens} out")
    header = f"{'setup':22} {'ok':>4} {'TTFT p50':>9} {'mean':>8} {'p99':>8}"
    print(f"{header} {'KV bytes/request':>17} {'remote prefills':>16}")
    for label, report, counters in rows:
        ttft = report["ttft_ms"]
        moved, remote = counters["moved"], counters["remote"]
        per_request = moved / remote if remote else 0
        print(
            f"{label:22} {report['completed']:>4} {ttft['p50']:9.1f} {ttft['mean']:8.1f} {ttft['p99']:8.1f} "
            f"{per_request:17,.0f} {remote:16.0f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=str(SHARED_TRACE), help="Mooncake JSONL trace (default: the shared one)")
    parser.add_argument("--trace-start", type=int, default=3600, help="first trace request of the window")
    parser.add_argument("--trace-requests", type=int, default=300, help="requests in the window")
    parser.add_argument("--trace-block-size", type=int, default=32, help="token ids per trace hash id (a vLLM block)")
    parser.add_argument("--arrival-speedup-ratio", type=float, default=1.0, help="divide trace timestamps by this")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument(
        "--model-shape",
        choices=sorted(tiny_llama.SHAPES),
        default=tiny_llama.DEFAULT_SHAPE,
        help="routing: the random-weight Llama the workers serve (kvmesh build-tiny-model --shape): tiny computes "
        "a prompt in about what the serving path adds, small in several times that, as a real model does on "
        "its accelerator, so what a cache hit saves shows in time to first token (docs/decisions/0074)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="routing: run every setup this many times (the order rotated each time) and pool their requests; "
        "the table also shows each run's TTFT p50 and p99, and kv's differences from the other setups with "
        "95%% intervals over the runs and their requests",
    )
    parser.add_argument(
        "--setups",
        nargs="+",
        choices=MODES,
        default=list(MODES),
        help="routing: the setups to run (default: all three; kv always runs, as the others are compared with it)",
    )
    parser.add_argument(
        "--cache-replies",
        action="store_true",
        help="routing, a session trace: each turn waits for its session's previous answer, whose reply blocks are "
        "first prefilled on the worker that served it, where a real reply's KV would be (kvmesh bench "
        "--cache-replies; docs/decisions/0075)",
    )
    parser.add_argument("--num-gpu-blocks", type=int, default=1024, help="each worker's KV cache, in blocks")
    parser.add_argument("--output-tokens", type=int, default=16, help="cap each request's output")
    parser.add_argument("--output-dir", default="bench-results/vllm-routing", help="reports and the plot")
    parser.add_argument("--prefix-tokens", type=int, default=1024, help="disagg: tokens per distinct prompt")
    parser.add_argument("--part", choices=("routing", "disagg", "all"), default="all")
    parser.add_argument("--disagg-requests", type=int, default=20)
    parser.add_argument(
        "--kv-duplicate-penalty",
        type=float,
        default=None,
        help="routing: also run kv with this --kv-duplicate-penalty, a fourth setup named kv-penalty (0: plain kv; "
        "the kv setup has the router's default, 128); not given: no fourth setup",
    )
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.part in ("disagg", "all"):
        disagg_part(args)
    if args.part == "disagg":
        return
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        window = Path(tmp) / "window.jsonl"
        trace, too_long = trace_window(
            Path(args.trace), args.trace_start, args.trace_requests, args.trace_block_size, window
        )
        bounds = window_bounds(trace, args)
        chosen = [mode for mode in MODES if mode == "kv" or mode in args.setups]
        setups = [*chosen, PENALISED] if args.kv_duplicate_penalty is not None else chosen
        runs = run_repeats(setups, trace, args, out_dir)
    rows = [(mode, pooled(mode, reports)) for mode, reports in runs.items()]
    print(
        f"\n{args.workers} vLLM workers (CPU, kvmesh-tiny Llama of the {args.model_shape} shape, "
        f"{args.num_gpu_blocks} blocks of "
        f"{args.trace_block_size} tokens each), trace requests {args.trace_start}-"
        f"{args.trace_start + args.trace_requests - 1} at {args.arrival_speedup_ratio}x, "
        f"{args.output_tokens} output tokens at most; {too_long} requests longer than the context left out"
    )
    print(
        f"what any router could keep of its prompt tokens: {bounds.infinite:.3f} with every block kept, "
        f"{bounds.fleet_lru:.3f} with one LRU cache of the fleet's {args.workers * args.num_gpu_blocks} blocks"
    )
    if args.repeats > 1:
        print(f"{args.repeats} runs of each setup, their requests pooled; the runs' own TTFT p50s and p99s after |")
    print(f"{'router':12} {'ok':>4} {'cached':>7} {'TTFT p50':>9} {'p99':>8} {'req/s':>6} {'out tok/s':>9}")
    for mode, report in rows:
        ttft = report["ttft_ms"]
        spread = "" if args.repeats == 1 else " | " + run_spread(runs[mode])
        print(
            f"{mode:12} {report['completed']:>4} {report['cached_token_ratio']:7.3f} {ttft['p50']:9.1f} "
            f"{ttft['p99']:8.1f} {report['request_throughput_per_s']:6.2f} {report['output_tokens_per_s']:9.1f}"
            f"{spread}"
        )
    print("per worker (requests, cached share of its prompt tokens, TTFT p50):")
    for mode, reports in runs.items():
        for index, report in enumerate(reports):
            run = "" if args.repeats == 1 else f" run {index}"
            print(f"  {mode + run:18} " + "; ".join(per_worker(report)))
    if args.repeats > 1:
        print("kv's pooled figure minus the other's [95% interval, resampling the runs and their requests]:")
        for other in (mode for mode in ("cache-aware", "round-robin") if mode in runs):
            apart = differences(*([report["per_request"] for report in runs[mode]] for mode in ("kv", other)))
            print(f"  kv - {other:12} " + "; ".join(map(str, apart)))
    steered = [f"{mode} {report['steered']}" for mode, report in rows if report.get("steered")]
    print("requests moved off a stalled worker or one whose decodes were behind: " + ("; ".join(steered) or "none"))
    p50 = {mode: report["ttft_ms"]["p50"] for mode, report in rows}
    if "round-robin" in p50:
        print(f"kv TTFT p50 / round-robin's: {p50['kv'] / p50['round-robin']:.2f} (target: 0.50 or less)")
    reports = [out_dir / mode / "report.json" for mode, _ in rows]
    if args.repeats > 1:  # one run's report is already there; pooled ones are written for the plot
        for path, (_, report) in zip(reports, rows, strict=True):
            path.write_text(json.dumps(report, indent=2) + "\n")
    subprocess.run(
        [sys.executable, "-m", "kvmesh", "bench", "--compare", *map(str, reports), "--output-dir", str(out_dir)],
        check=True,
    )
    print(f"plot: {out_dir / 'compare_cdf.png'}")


if __name__ == "__main__":
    main()
