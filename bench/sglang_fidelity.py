"""Live fidelity of kvmesh's ``cache-aware`` mode to the real sglang-router 0.3.2 ``cache_aware`` policy.

Starts ``--workers`` simple mock HTTP workers (``../shared/peers/mock_worker.py``, which answer
"mock <name>") and sglang-router 0.3.2 in front of them, with its default options, from the
virtualenv ``../shared/peers/README.md`` installs (``--sglang-python``). Sends a request sequence
one at a time (shared system prompts, growing multi-turn conversations, one-off prompts) to the
router's ``/v1/completions``, records the worker that answered each, and stops everything it started.

The same sequence then goes through kvmesh's :class:`CacheAwareSelector`. SGLang's tree holds
characters and kvmesh's tokens; the prompts are ASCII and kvmesh's tiny model tokenises byte by
byte (decision 0004), so both measure the same lengths. Two figures:

- **teacher-forced**: before each request kvmesh's tree holds SGLang's *actual* past choices; the
  request agrees when SGLang's worker is one kvmesh's rule allows (where several workers tie,
  SGLang takes the first it lists, an order it does not define, so the tied ones all agree); the
  strict figure (kvmesh's own tie-break) and the agreement on the requests SGLang's tree matched
  (hits) alone are printed beside it;
- **free-running**: kvmesh routes the whole sequence on its own tree (both start from the
  warm-up's choices), and its choices are compared with SGLang's.

Both are printed for each ``--cache-miss-policy``: ``smallest-tree`` (SGLang's documented policy)
and ``least-loaded`` (what sglang-router 0.3.2's code does on a miss; decision 16).

    python -m bench.sglang_fidelity [--requests 600 --workers 3 --seed 0]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from bench.processes import start_in_session, stop_sessions
from kvmesh.common.wire.hashing import token_bytes
from kvmesh.router.cache_aware import MISS_POLICIES, CacheAwareOptions, CacheAwareSelector

PEERS = Path(__file__).resolve().parents[2] / "shared" / "peers"
WORDS = [f"{a}{b}" for a in ("ka", "lo", "mi", "nu", "pe", "ro", "si", "tu", "va", "ze") for b in "aeiouxyz"]


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def request_sequence(count: int, seed: int) -> list[str]:
    """Prompts of a chat service: a few system prompts, conversations that grow turn by turn, one-offs."""
    rng = random.Random(seed)
    systems = [f"system {i}: " + words(rng, rng.randint(40, 300)) for i in range(10)]
    conversations: list[str] = []
    prompts = []
    for _ in range(count):
        roll = rng.random()
        if roll < 0.45 and conversations:  # the next turn of a conversation
            index = rng.randrange(len(conversations))
            conversations[index] += (
                f" user: {words(rng, rng.randint(5, 60))} assistant: {words(rng, rng.randint(5, 40))}"
            )
            prompts.append(conversations[index])
        elif roll < 0.9:  # a new conversation under a shared system prompt
            conversations.append(rng.choice(systems) + f" user: {words(rng, rng.randint(5, 80))}")
            prompts.append(conversations[-1])
        else:  # a one-off
            prompts.append("one-off: " + words(rng, rng.randint(20, 200)))
    return prompts


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)


def sglang_choices(
    warmup: list[str], prompts: list[str], python: str, workers: int, base_port: int, delay_ms: float
) -> tuple[list[str], list[str]]:
    """The worker sglang-router chose for each warm-up prompt (sent all at once) and each prompt
    (sent one at a time)."""
    started: list[subprocess.Popen[bytes]] = []
    logs = Path(os.environ.get("TMPDIR", "/tmp"))

    def start(argv: list[str], log: str) -> None:
        with open(logs / log, "wb") as out:
            started.append(start_in_session(argv, stdout=out, stderr=subprocess.STDOUT))

    try:
        ports = [base_port + 1 + i for i in range(workers)]
        for port in ports:
            mock = [python, str(PEERS / "mock_worker.py"), "--port", str(port), "--name", f"w{port}"]
            mock += ["--delay-ms", str(delay_ms), "--log", str(logs / f"fidelity_mock_{port}.paths")]
            start(mock, f"fidelity_mock_{port}.log")
        router = [python, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(base_port)]
        router += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(base_port + 50)]
        router += ["--policy", "cache_aware", "--log-level", "warn", "--worker-urls"]
        router += [f"http://127.0.0.1:{port}" for port in ports]
        start(router, "fidelity_sglang_router.log")
        url = f"http://127.0.0.1:{base_port}/v1/completions"
        deadline = time.monotonic() + 60
        while True:  # healthy once it has probed every worker (its process title is "sglang::router")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{base_port}/health", timeout=5):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("sglang-router did not answer within 60 s") from None
                time.sleep(0.5)

        def send(prompt: str) -> str:
            return post(url, {"model": "tiny", "prompt": prompt, "max_tokens": 1})["choices"][0]["text"]

        with concurrent.futures.ThreadPoolExecutor(len(warmup)) as pool:
            warmed = list(pool.map(send, warmup))
        return warmed, [send(prompt) for prompt in prompts]
    finally:
        stop_sessions(started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=300, help="concurrent warm-up requests (see the docstring)")
    parser.add_argument("--delay-ms", type=float, default=100.0, help="each mock worker's answer delay")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sglang-python", default="/tmp/peers/sgl/bin/python")
    parser.add_argument("--base-port", type=int, default=18130)
    args = parser.parse_args()
    if not Path(args.sglang_python).exists():
        sys.exit(f"{args.sglang_python} not found: install sglang-router 0.3.2 as ../shared/peers/README.md says")
    rng = random.Random(args.seed + 1)
    warmup = [f"warm-up {i}: " + words(rng, 30) for i in range(args.warmup)]
    prompts = request_sequence(args.requests, args.seed)
    warmed, theirs = sglang_choices(warmup, prompts, args.sglang_python, args.workers, args.base_port, args.delay_ms)
    workers = [f"mock w{args.base_port + 1 + i}" for i in range(args.workers)]
    print(f"{len(prompts)} requests, {args.workers} workers: sglang-router 0.3.2 cache_aware (defaults), kvmesh")
    print(f"warm-up ({args.warmup} at once) per worker: { {w: warmed.count(w) for w in workers} }")
    print(f"SGLang's choices per worker: { {w: theirs.count(w) for w in workers} }")
    for policy in MISS_POLICIES:
        compare(policy, workers, warmup, warmed, prompts, theirs, args.seed)


def compare(
    policy: str,
    workers: list[str],
    warmup: list[str],
    warmed: list[str],
    prompts: list[str],
    theirs: list[str],
    seed: int,
) -> None:
    """kvmesh's cache-aware with ``--cache-miss-policy policy`` against SGLang's choices: teacher-forced
    (kvmesh's tree holds what SGLang sent where; a choice agrees when SGLang's worker is one kvmesh
    could have picked), strictly (kvmesh's own tie-break), on the requests SGLang's tree matched
    (hits) alone, and free-running (each with its own tree)."""
    key = {name: (i, 0) for i, name in enumerate(workers)}
    candidates = list(key.values())
    options = CacheAwareOptions(miss_policy=policy)
    forced = CacheAwareSelector(options, random.Random(seed))
    free = CacheAwareSelector(options, random.Random(seed))
    for prompt, choice in zip(warmup, warmed, strict=True):  # both start from SGLang's state after the warm-up
        for selector in (forced, free):
            selector.tree.insert(token_bytes(list(prompt.encode())), key[choice], 0.0)
    idle = [0] * len(candidates)  # requests are sent one at a time: nothing is in flight at a choice
    tied_agree = strict_agree = ties = hits = hit_agree = 0
    ours = []
    for step, (prompt, choice) in enumerate(zip(prompts, theirs, strict=True), start=1):
        tokens = token_bytes(list(prompt.encode()))
        matched, holders = forced.tree.holders(tokens, set(candidates))
        total = len(tokens) // 4
        if holders and total and matched / total > options.cache_threshold:
            allowed = set(holders)
            hits += 1
            hit_agree += key[choice] in allowed
        else:
            allowed = set(forced.miss_candidates(candidates, idle)[0])
        ties += len(allowed) > 1
        tied_agree += key[choice] in allowed
        strict_agree += forced.select(candidates, tokens, {}, float(step), commit=False).worker == key[choice]
        forced.tree.insert(tokens, key[choice], float(step))
        ours.append(free.select(candidates, tokens, {}, float(step)).worker)
    same = sum(mine == key[choice] for mine, choice in zip(ours, theirs, strict=True))
    n = len(prompts)
    print(f"--cache-miss-policy {policy}:")
    print(f"  teacher-forced agreement: {tied_agree / n:.4f} ({tied_agree}/{n}; {ties} requests had tied workers)")
    print(f"  on SGLang-tree hits alone: {hit_agree / max(hits, 1):.4f} ({hit_agree}/{hits})")
    print(f"  strict (kvmesh's own tie-break): {strict_agree / n:.4f}")
    print(f"  free-running agreement: {same / n:.4f} ({same}/{n})")


if __name__ == "__main__":
    main()
