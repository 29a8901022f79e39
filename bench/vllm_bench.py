"""KV-aware routing in front of real engines: 2 vLLM workers (CPU build, the tiny random-weight
Llama), a shared-prefix workload routed ``kv`` and ``round-robin``, side by side in one run.

Each setup is a fresh ``kvmesh up --engine vllm --workers 2`` (so neither inherits the other's
caches), loaded by ``kvmesh bench``'s synthetic workload: ``--num-prefixes`` shared prefixes of
``--prefix-tokens`` tokens, each request a prefix plus a unique suffix. Printed per setup: the
fraction of prompt tokens vLLM served from its prefix cache (``usage.prompt_tokens_details``),
TTFT p50/p99, requests/s and output tokens/s; the setups alternate ``--rounds`` times.

``--part disagg`` compares 1 aggregated vLLM worker with 1 prefill + 1 decode worker (KV over vLLM's
NIXL connector) on distinct prompts sent one at a time: TTFT, and the KV bytes and blocks each
request moved (from the router's counters).

    VLLM_CPU_KVCACHE_SPACE=1 python -m bench.vllm_bench [--part routing|disagg|all] [--num-requests 120]
"""

from __future__ import annotations

import argparse
import os
import re

import httpx

from bench.live_load import run_load
from kvmesh.devtools.mesh_process import MeshProcess
from tests.support import discovered

ENGINE_ARGS = ["--block-size", "32", "--max-model-len", "2048", "--gpu-memory-utilization", "0.5", "--enforce-eager"]


def run_setup(mode: str, args: argparse.Namespace) -> dict:
    mesh = MeshProcess(
        "--engine", "vllm", "--workers", "2", "--router-mode", mode, "--log-level", "warning", *ENGINE_ARGS
    ).start(timeout=600)
    try:
        return run_load(
            mesh.api,
            mode,
            "--endpoint",
            "completions",
            "--num-requests",
            str(args.num_requests),
            "--num-prefixes",
            str(args.num_prefixes),
            "--prefix-tokens",
            str(args.prefix_tokens),
            "--suffix-tokens",
            str(args.suffix_tokens),
            "--output-tokens",
            str(args.output_tokens),
            "--concurrency",
            str(args.concurrency),
            "--seed",
            str(args.seed),
        )
    finally:
        mesh.stop()


def router_counters(mesh: MeshProcess) -> dict[str, float]:
    """The router's prefill and KV-transfer counters, by their label text."""
    (router,) = discovered(mesh.nats_url, "router")
    text = httpx.get(f"http://{router.extra['metrics']}/metrics", timeout=10).text
    found = re.findall(r"^kvmesh_router_(prefills|kv_transfer_bytes)_total\{([^}]*)\} (\S+)$", text, re.MULTILINE)
    return {f"{name}{{{labels}}}": float(value) for name, labels, value in found}


def disagg_part(args: argparse.Namespace) -> None:
    setups = [
        ("1 aggregated", ["--workers", "1"]),
        ("1 prefill + 1 decode", ["--workers", "1", "--prefill-workers", "1", "--disagg-min-uncached-tokens", "0"]),
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
            counters = router_counters(mesh)
        finally:
            mesh.stop()
        rows.append((label, report, counters))
    print(f"\n{requests} distinct prompts of ~{args.prefix_tokens} tokens, one at a time, {args.output_tokens} out")
    header = f"{'setup':22} {'ok':>4} {'TTFT p50':>9} {'mean':>8} {'p99':>8}"
    print(f"{header} {'KV bytes/request':>17} {'remote prefills':>16}")
    for label, report, counters in rows:
        ttft = report["ttft_ms"]
        moved = sum(v for k, v in counters.items() if k.startswith("kv_transfer_bytes"))
        remote = sum(v for k, v in counters.items() if k.startswith("prefills") and 'where="remote"' in k)
        per_request = moved / remote if remote else 0
        print(
            f"{label:22} {report['completed']:>4} {ttft['p50']:9.1f} {ttft['mean']:8.1f} {ttft['p99']:8.1f} "
            f"{per_request:17,.0f} {remote:16.0f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=120)
    parser.add_argument("--num-prefixes", type=int, default=6)
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--suffix-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1, help="alternate the two setups this many times")
    parser.add_argument("--part", choices=("routing", "disagg", "all"), default="all")
    parser.add_argument("--disagg-requests", type=int, default=20)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.part in ("disagg", "all"):
        disagg_part(args)
    if args.part == "disagg":
        return
    rows = []
    for _ in range(args.rounds):
        for mode in ("kv", "round-robin"):
            rows.append((mode, run_setup(mode, args)))
    print(
        f"\n2 vLLM workers (CPU, kvmesh-tiny Llama), {args.num_requests} requests at concurrency {args.concurrency}: "
        f"{args.num_prefixes} prefixes of {args.prefix_tokens} tokens + {args.suffix_tokens} unique, "
        f"{args.output_tokens} output tokens"
    )
    print(f"{'router':12} {'ok':>4} {'cached':>7} {'TTFT p50':>9} {'p99':>8} {'req/s':>6} {'out tok/s':>9}")
    for mode, report in rows:
        ttft = report["ttft_ms"]
        print(
            f"{mode:12} {report['completed']:>4} {report['cached_token_ratio']:7.3f} {ttft['p50']:9.1f} "
            f"{ttft['p99']:8.1f} {report['request_throughput_per_s']:6.2f} {report['output_tokens_per_s']:9.1f}"
        )


if __name__ == "__main__":
    main()
