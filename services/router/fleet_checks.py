"""The router's checks for a misconfigured fleet (the anchors' users' most reported traps), each said
once through :class:`~kvmesh.common.runtime.misconfiguration.Findings`:

- ``block_sizes``: workers of one model with different block sizes, which can never share a prefix
  (the router hashes a prompt at one block size: the others are routed on load alone);
- ``kv_events``: a worker this router has sent requests to for a while whose blocks no indexer
  answer has ever listed: its KV events do not reach the indexers;
- ``no_indexer``: with KV events on, no indexer replica registered or answering: routing on load alone;
- ``unknown_model``: requests for a model no registered worker serves.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from kvmesh.common.runtime.discovery import InstanceRecord
from kvmesh.common.runtime.misconfiguration import Findings
from kvmesh.router.indexer_client import IndexerClient

BLOCK_SIZES = "block_sizes"
KV_EVENTS = "kv_events"
NO_INDEXER = "no_indexer"
UNKNOWN_MODEL = "unknown_model"
# A worker's events reach the indexers within milliseconds; after this long and this many requests
# sent to it with none of its blocks in any answer, they are not coming.
EVENTS_GRACE_S = 10.0
EVENTS_MIN_REQUESTS = 5
# A router may start before its indexers: no indexer for this long is a finding.
NO_INDEXER_GRACE_S = 10.0
MAX_UNKNOWN_MODELS = 16  # the names are the clients': a bound on what is kept


def split_block_sizes(workers: Sequence[InstanceRecord]) -> dict[str, Counter[int]]:
    """Per model whose workers do not all have one block size: how many have each."""
    sizes: dict[str, Counter[int]] = {}
    for worker in workers:  # prefill workers too: their blocks must line up with the decode side's
        sizes.setdefault(worker.model, Counter())[worker.block_size] += 1
    return {model: counts for model, counts in sizes.items() if len(counts) > 1}


def served_models(workers: Sequence[InstanceRecord]) -> list[str]:
    return sorted({worker.model for worker in workers})


def quoted(names: Sequence[str]) -> str:
    return ", ".join(repr(name) for name in names) or "none"


class FleetChecks:
    """Keeps what the checks need between runs: when each worker was first sent a request by this
    router and how many it was sent; :meth:`check` runs them all."""

    def __init__(self, findings: Findings, kv_events: bool, clock: Callable[[], float]) -> None:
        self.findings = findings
        self.kv_events = kv_events
        self._clock = clock
        self._started = clock()
        self._sent: dict[int, tuple[float, int]] = {}  # worker -> (first sent at, requests sent)
        # workers an indexer answer has listed with blocks, ever (read at each check, off the request
        # path: a worker holds its blocks for longer than the checks' period)
        self._covered: set[int] = set()

    def sent(self, worker_id: int) -> None:
        first, count = self._sent.get(worker_id, (self._clock(), 0))
        self._sent[worker_id] = (first, count + 1)

    def worker_left(self, worker_id: int) -> None:
        self._sent.pop(worker_id, None)

    def no_worker_for(self, model: str, workers: Sequence[InstanceRecord]) -> str:
        """The refusal's message for a model no worker serves; a finding when workers serve others."""
        models = served_models(workers)
        if not models:
            return f"for model {model!r}: no worker is registered"
        message = (
            f"for model {model!r}: the workers serve {quoted(models)}; send one of those names as the model, "
            f"or start workers for {model!r} (--model-name)"
        )
        open_models = self.findings.keys(UNKNOWN_MODEL)
        if model in open_models or len(open_models) < MAX_UNKNOWN_MODELS:
            self.findings.found(UNKNOWN_MODEL, model, f"requests came {message}")
        return message

    def check(self, workers: Sequence[InstanceRecord], indexers: int, client: IndexerClient | None) -> None:
        """Run every check against the fleet as discovery and the indexers' answers show it now."""
        now = self._clock()
        splits = split_block_sizes(workers)
        for model, counts in splits.items():
            shares = ", ".join(f"{n} with {size}" for size, n in sorted(counts.items()))
            self.findings.found(
                BLOCK_SIZES,
                model,
                f"the workers of model {model!r} have different KV block sizes ({shares} tokens per block): "
                "workers of different block sizes can never share a cached prefix, and the router hashes each "
                "prompt at one size; start every worker of a model with the same --block-size",
            )
        self.findings.keep_only(BLOCK_SIZES, splits)
        self.findings.keep_only(UNKNOWN_MODEL, self.findings.keys(UNKNOWN_MODEL) - set(served_models(workers)))
        if not self.kv_events or client is None:
            return
        self._check_indexers(now, indexers, client)
        self._check_events(now, workers, client)

    def _check_indexers(self, now: float, indexers: int, client: IndexerClient) -> None:
        if not indexers and now - self._started >= NO_INDEXER_GRACE_S:
            self.findings.found(
                NO_INDEXER,
                "",
                "no indexer replica is registered, so this router routes on load alone, blind to what the workers "
                "cache: start one (kvmesh indexer) on the same NATS and --namespace, or run the router with "
                "--no-kv-events to predict caches from its own decisions",
            )
        elif indexers and client.load_only_since is not None:
            self.findings.found(
                NO_INDEXER,
                "",
                f"none of the {indexers} registered indexer replicas answers overlap queries (within "
                "--indexer-timeout-ms), so this router routes on load alone: see their logs and kvmesh inspect indexer",
            )
        elif indexers and client.load_only_since is None:
            self.findings.resolved(NO_INDEXER, "")

    def _check_events(self, now: float, workers: Sequence[InstanceRecord], client: IndexerClient) -> None:
        silent = []
        answered = client.last_answer_at
        self._covered.update(worker for (worker, _rank), blocks in client.last_sizes.items() if blocks)
        for worker in workers:
            first, count = self._sent.get(worker.instance_id, (now, 0))
            if worker.instance_id in self._covered or worker.role == "prefill":
                continue
            if count >= EVENTS_MIN_REQUESTS and now - first >= EVENTS_GRACE_S and answered and answered > first:
                silent.append(worker)
                self.findings.found(
                    KV_EVENTS,
                    str(worker.instance_id),
                    f"worker {worker.instance_id} at {worker.address} was sent {count} requests in the last "
                    f"{now - first:.0f} s, yet no indexer holds a block of it: its KV events do not reach the "
                    "indexers, so its cache is invisible to routing. Check that its engine publishes KV events "
                    "(vLLM: --kv-events-config, prefix caching on), that it uses this NATS and --namespace, and "
                    "its --kv-events-flush-ms",
                )
        self.findings.keep_only(KV_EVENTS, [str(w.instance_id) for w in silent])
