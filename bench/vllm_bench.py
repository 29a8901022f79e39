"""KV-aware routing in front of real engines: 2 vLLM workers (CPU build, the tiny random-weight
Llama), a shared-prefix workload routed ``kv`` and ``round-robin``, side by side in one run.

Each setup is a fresh ``kvmesh up --engine vllm --workers 2`` (so neither inherits the other's
caches), loaded by ``kvmesh bench``'s synthetic workload: ``--num-prefixes`` shared prefixes of
``--prefix-tokens`` tokens, each request a prefix plus a unique suffix. Printed per setup: the
fraction of prompt tokens vLLM served from its prefix cache (``usage.prompt_tokens_details``),
TTFT p50/p99, requests/s and output tokens/s; the setups alternate ``--rounds`` times.

    VLLM_CPU_KVCACHE_SPACE=1 python -m bench.vllm_bench [--num-requests 120] [--concurrency 4] [--rounds 1]
"""

from __future__ import annotations

import argparse
import os

from bench.live_load import run_load
from kvmesh.up import MeshProcess

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
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
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
