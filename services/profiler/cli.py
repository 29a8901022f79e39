"""``kvmesh profile``: measure an engine into an engine profile file for the planner."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path

from kvmesh.common.core.engine_profile import EngineProfile, ProfileError
from kvmesh.common.core.timing import TimingModel
from kvmesh.common.runtime.structured_logging import configure_logging
from kvmesh.profiler.live import profile_worker
from kvmesh.profiler.mock import profile_mock_engine
from kvmesh.worker.engines.mock.mock_engine import EngineConfig


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvmesh profile",
        description=(
            "Measure one worker's engine: TTFT by uncached prompt length (idle worker) and inter-token latency "
            "by concurrency and context; write the engine profile the planner sizes pools from. The mock engine "
            "is measured by running it in virtual time (its points agree with its timing model)."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--engine", choices=("mock",), default="mock", help="which engine to measure in virtual time (no worker needed)"
    )
    parser.add_argument(
        "--worker-address",
        help="measure this running worker (mock or vLLM) over its gRPC API in real time instead, HOST:PORT",
    )
    parser.add_argument("--vocab-size", type=int, default=256, help="--worker-address: prompt token ids lie below this")
    parser.add_argument(
        "--max-prompt-tokens", type=int, default=8192, help="--worker-address: longest prompt (the model's context)"
    )
    parser.add_argument("--output", type=Path, default=Path("engine-profile.json"), help="profile file to write")
    parser.add_argument("--block-size", type=int, default=64, help="tokens per KV block")
    parser.add_argument("--num-gpu-blocks-override", type=int, default=16384, help="KV blocks per worker")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="running sequences per worker")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192, help="token budget of one step")
    parser.add_argument("--speedup-ratio", type=float, default=1.0, help="the mock engine's speed-up")
    args = parser.parse_args(argv)
    configure_logging("warning", service="profile")
    for name in ("block_size", "num_gpu_blocks_override", "max_num_seqs", "max_num_batched_tokens", "speedup_ratio"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.worker_address:
        if args.vocab_size < 2 or args.max_prompt_tokens < 512:
            parser.error("--vocab-size must be at least 2 and --max-prompt-tokens at least 512")
        try:
            profile = asyncio.run(profile_worker(args.worker_address, args.vocab_size, args.max_prompt_tokens))
        except ProfileError as exc:
            parser.error(str(exc))
        profile.save(args.output)
        print(describe(args.output, profile))
        return 0
    config = EngineConfig(
        num_blocks=args.num_gpu_blocks_override,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        timing=TimingModel(speedup_ratio=args.speedup_ratio),
    )
    profile = profile_mock_engine(config)
    profile.save(args.output)
    print(describe(args.output, profile))
    return 0


def describe(path: Path, profile: EngineProfile) -> str:
    first, last = profile.prefill[0], profile.prefill[-1]
    return (
        f"wrote {path}: {len(profile.prefill)} prefill points ({first.ttft_ms:.1f} ms at {first.uncached_tokens} "
        f"tokens … {last.ttft_ms:.0f} ms at {last.uncached_tokens}), {len(profile.decode)} decode points"
    )


if __name__ == "__main__":
    sys.exit(main())
