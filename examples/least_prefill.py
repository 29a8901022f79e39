"""Pick the worker with the least prefill work for a prompt, then send the prompt there.

    kvmesh up &
    python examples/least_prefill.py      # finds the running mesh through its run file

Uses the typed router client (services/client.py): PotentialLoads asks the router what each worker's
load would be with this request (prefill tokens left after its cached prefix, queued prefill, active
blocks) without routing anything; Generate with a worker id then forces that worker.
"""

from __future__ import annotations

import argparse
import asyncio

from kvmesh.client import RouterApi
from kvmesh.common.core.tiny_model import MODEL_DIR
from kvmesh.frontend.tokenizer import ModelTokenizer


async def main(nats_url: str, prompt: str) -> None:
    token_ids = ModelTokenizer(MODEL_DIR).encode(prompt)
    async with await RouterApi.discover(nats_url) as api:
        loads = await api.potential_loads(token_ids)
        for load in loads:
            print(
                f"worker {load.worker_id}: {load.potential_prefill_tokens} prefill tokens if sent there "
                f"({load.overlap_blocks} blocks cached), {load.potential_decode_blocks} active blocks"
            )
        target = min(loads, key=lambda w: w.potential_prefill_tokens)
        answer = await api.complete(token_ids, max_tokens=16, worker_id=target.worker_id)
        print(
            f"sent to worker {answer.worker_id}: {answer.completion_tokens} tokens, "
            f"{answer.cached_tokens} prompt tokens from cache"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nats-url", help="NATS server URL (default: that of the running `kvmesh up`)")
    parser.add_argument("--prompt", default="An example prompt long enough to fill a few KV blocks. " * 4)
    args = parser.parse_args()
    asyncio.run(main(args.nats_url, args.prompt))
