"""``kvmesh bench``: drive any OpenAI-compatible endpoint with a trace or a shared-prefix workload."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path

import openai

from kvmesh.common.core.tiny_model import MODEL_DIR, MODEL_NAME
from kvmesh.common.runtime.run_file import default_namespace, read_run_record
from kvmesh.common.runtime.structured_logging import configure_logging
from kvmesh.common.wire.priority import parse_mix
from kvmesh.frontend.tokenizer import ModelTokenizer
from kvmesh.loadgen.report import build_report, compare, reply_summary, write_outputs
from kvmesh.loadgen.runner import LoadRunner
from kvmesh.loadgen.session_turns import link_turns
from kvmesh.loadgen.workload import (
    BenchRequest,
    TracePromptBuilder,
    assign_priorities,
    check_shared_prefixes,
    synthetic_workload,
    trace_workload,
)
from kvmesh.replay.mooncake_trace import TraceError, read_trace

DEFAULT_API = "http://127.0.0.1:8000/v1"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvmesh bench",
        description=(
            "Load an OpenAI-compatible endpoint (kvmesh's or any other) with streaming requests from a Mooncake "
            "trace or a synthetic shared-prefix workload; measure TTFT, ITL, end-to-end latency, throughput and "
            "cached tokens; write report.json and PNG plots. With --compare, plot earlier reports together."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--url",
        default=None,
        help="base URL of the OpenAI API (default: that of the running `kvmesh up`, else http://127.0.0.1:8000/v1)",
    )
    parser.add_argument("--model", default=MODEL_NAME, help="model name to request")
    parser.add_argument("--api-key", default="unused", help="API key sent as a bearer token")
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=MODEL_DIR,
        help="model directory whose tokenizer.json builds and checks the prompts",
    )
    parser.add_argument(
        "--endpoint",
        choices=("completions", "chat"),
        default="completions",
        help="/v1/completions (prompt as is) or /v1/chat/completions (one user message)",
    )
    workload = parser.add_argument_group("workload (a trace, or the synthetic shared-prefix set)")
    workload.add_argument(
        "--trace", type=Path, help="Mooncake JSONL trace to replay live (a request's session_id goes as x-session-id)"
    )
    workload.add_argument("--trace-block-size", type=int, default=512, help="tokens per trace hash id")
    workload.add_argument("--arrival-speedup-ratio", type=float, default=1.0, help="divide trace timestamps by this")
    workload.add_argument("--limit", type=int, help="send only the first N trace requests")
    workload.add_argument("--max-output-tokens", type=int, help="cap each trace request's output length")
    workload.add_argument(
        "--cache-replies",
        action="store_true",
        help="session traces: send each turn after its session's previous answer, and before it prefill that "
        "answer's reply blocks (one output token) on the worker that served it, where a real reply's KV would be "
        "(kvmesh endpoints only: the worker is read from x-kvmesh-worker-id); these prefills are not measured",
    )
    workload.add_argument("--num-requests", type=int, default=100, help="synthetic: requests to send")
    workload.add_argument("--num-prefixes", type=int, default=4, help="synthetic: distinct shared prefixes")
    workload.add_argument("--prefix-tokens", type=int, default=512, help="synthetic: tokens per shared prefix")
    workload.add_argument("--suffix-tokens", type=int, default=64, help="synthetic: unique tokens per request")
    workload.add_argument("--output-tokens", type=int, default=32, help="synthetic: max_tokens per request")
    workload.add_argument("--seed", type=int, default=0, help="synthetic: seed of the request mix")
    workload.add_argument(
        "--priority-mix",
        default="",
        help="send each request with an x-kvmesh-priority class drawn from these shares (with --seed), e.g. "
        "high=0.2,normal=0.5,low=0.3; the report then gives each class's refusals and TTFT",
    )
    pacing = parser.add_argument_group("pacing (default: trace timestamps, or concurrency 8 for synthetic)")
    pacing.add_argument("--request-rate", type=float, help="send at this fixed rate (requests/s)")
    pacing.add_argument("--concurrency", type=int, help="closed loop: this many clients back to back")
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    parser.add_argument(
        "--output-dir", type=Path, default=Path("bench-results"), help="where report.json and the plots go"
    )
    parser.add_argument("--label", default=None, help="name of this run in plots (default: the endpoint URL)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--compare",
        type=Path,
        nargs="+",
        metavar="REPORT",
        help="plot these report.json files together into OUTPUT_DIR/compare_cdf.png and exit",
    )
    return parser


def make_workload(args: argparse.Namespace, tokenizer: ModelTokenizer) -> tuple[list[BenchRequest], int]:
    """The requests to send and the block size their shared prefixes are checked at."""
    if args.trace is not None:
        trace = read_trace(args.trace)
        if args.limit is not None:
            trace = trace[: args.limit]
        builder = TracePromptBuilder(tokenizer, args.trace_block_size)
        requests = trace_workload(trace, builder, args.arrival_speedup_ratio, args.max_output_tokens)
        if args.cache_replies:
            requests = link_turns(trace, requests, builder)
        return requests, args.trace_block_size
    requests = synthetic_workload(
        tokenizer,
        args.num_requests,
        args.num_prefixes,
        args.prefix_tokens,
        args.suffix_tokens,
        args.output_tokens,
        args.seed,
    )
    return requests, args.prefix_tokens


async def run_load(args: argparse.Namespace, requests: list[BenchRequest]) -> tuple[list, list]:
    """The measured requests' results, and the reply prefills' (``--cache-replies``)."""
    from tqdm import tqdm

    client = openai.AsyncOpenAI(base_url=args.url, api_key=args.api_key, timeout=args.timeout, max_retries=0)
    progress = tqdm(total=len(requests), unit="req", disable=args.no_progress, desc="kvmesh bench")
    runner = LoadRunner(client, args.model, args.endpoint, on_done=lambda _r: progress.update(1))
    concurrency = args.concurrency
    if concurrency is None and args.request_rate is None and args.trace is None:
        concurrency = 8
    try:
        results = await runner.run(requests, request_rate=args.request_rate, concurrency=concurrency)
        return results, runner.replies
    finally:
        progress.close()
        await client.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging("warning", service="bench")  # results go to stdout, logs to stderr
    if args.compare:
        missing = [p for p in args.compare if not p.is_file()]
        if missing:
            parser.error(f"report not found: {missing[0]}")
        args.output_dir.mkdir(parents=True, exist_ok=True)
        target = args.output_dir / "compare_cdf.png"
        compare(args.compare, target)
        print(f"wrote {target}")
        return 0
    if args.concurrency is not None and args.request_rate is not None:
        parser.error("give --concurrency or --request-rate, not both")
    if args.url is None:
        running = read_run_record(default_namespace())
        args.url = running.api if running is not None else DEFAULT_API
        origin = f" (the kvmesh up with pid {running.pid})" if running else ""
        print(f"endpoint: {args.url}{origin}", file=sys.stderr)
    for name in ("concurrency", "num_requests", "num_prefixes", "prefix_tokens", "output_tokens", "trace_block_size"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.trace is not None and not args.trace.is_file():
        parser.error(f"trace file {args.trace} not found")
    if args.cache_replies and args.trace is None:
        parser.error("--cache-replies needs a --trace (a session-structured one)")
    try:
        tokenizer = ModelTokenizer(args.tokenizer)
        requests, check_block = make_workload(args, tokenizer)
    except (TraceError, ValueError, FileNotFoundError) as exc:
        parser.error(str(exc))
    if args.priority_mix:
        try:
            requests = assign_priorities(requests, parse_mix(args.priority_mix), args.seed)
        except ValueError as exc:
            parser.error(f"--priority-mix: {exc}")
    prefix_check = check_shared_prefixes(tokenizer, requests, check_block)
    if prefix_check.mismatched:
        print(
            f"warning: {prefix_check.mismatched} prompts do not tokenise to their trace blocks "
            f"(first: request {prefix_check.first_mismatch})",
            file=sys.stderr,
        )
    results, replies = asyncio.run(run_load(args, requests))
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "compare"}
    report = build_report(args.label or args.url, settings, results, prefix_check)
    if args.cache_replies:
        report["cached_replies"] = reply_summary(requests, results, replies)
        print(
            f"replies: {report['cached_replies']['cached']} prefilled on their turns' workers, "
            f"{report['cached_replies']['failed']} failed, {report['cached_replies']['unplaced']} with no worker named",
            file=sys.stderr,
        )
    paths = write_outputs(report, args.output_dir)
    print(
        f"{report['completed']}/{report['requests']} completed, {report['errors']} errors, "
        f"{report['output_tokens_per_s']:.1f} output tok/s, TTFT p50 {_ms(report['ttft_ms']['p50'])} "
        f"p99 {_ms(report['ttft_ms']['p99'])}, cached tokens {report['cached_token_ratio']:.1%}"
    )
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0 if report["errors"] == 0 else 1


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


if __name__ == "__main__":
    sys.exit(main())
