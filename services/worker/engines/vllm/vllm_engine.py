"""vLLM's v1 async engine (``AsyncLLM``) in-process, as an :class:`Engine`.

Engine arguments are vLLM's own (``--model``, ``--max-model-len``, ``--gpu-memory-utilization``,
``--tensor-parallel-size``, ...), parsed by vLLM's own argument parser; the worker's
``--block-size``, ``--num-gpu-blocks-override``, ``--max-num-seqs`` and
``--max-num-batched-tokens`` are handed to vLLM when given. Prefix caching is always on, and vLLM's
KV event publisher is always enabled and relayed to JetStream (:mod:`~kvmesh.worker.engines.vllm.vllm_events`).
With no ``--model``, the random-weight ``kvmesh-tiny`` Llama is built on first use and served.

Data-parallel ranks (``--data-parallel-size N``) are vLLM's own: one ``AsyncLLM`` runs N engine
cores, each with a KV cache of its own, and a request goes to the rank the router chose
(``data_parallel_rank``). Each rank publishes its KV events on the configured ports plus its rank;
the worker relays rank r's as dp rank r (:class:`VllmRank`).

A prefill or decode worker moves KV with vLLM's own NIXL connector (host buffer on a CPU build,
device buffer on GPUs): a held prefill runs with ``do_remote_decode`` and its last output carries
vLLM's ``kv_transfer_params``; the decode side submits them with ``do_remote_prefill`` and vLLM pulls
the blocks (see :class:`~kvmesh.worker.kv_transfer.connector_handoff.ConnectorHandoff`).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import structlog

from kvmesh.common.core.timing import TimingModel
from kvmesh.common.core.timing_fit import TimingEvidence, TimingFit
from kvmesh.common.runtime.ports import free_port, free_port_run
from kvmesh.common.wire.finish_reasons import FinishReason
from kvmesh.common.wire.kv_events import EventData
from kvmesh.worker.engine import (
    CachedBlock,
    EngineFailure,
    EngineRequestError,
    EngineRequestSpec,
    TokenOutput,
    TokenQueue,
)
from kvmesh.worker.engines.streaming_engine import StreamingEngine
from kvmesh.worker.engines.vllm import tiny_llama, vllm_defaults
from kvmesh.worker.engines.vllm.vllm_events import OffloadedTiers, Publisher, VllmEventRelay
from kvmesh.worker.engines.vllm.vllm_plugin import QUIET_NIXL_ENV
from kvmesh.worker.kv_transfer.transport import TransferStats

log = structlog.get_logger(__name__)

_FINISH = {
    "length": FinishReason.LENGTH,
    "stop": FinishReason.STOP,
    "abort": FinishReason.CANCELLED,
    "repetition": FinishReason.STOP,  # vLLM stopped a repeating output: a stop of its own
}
# vLLM's "error" finish: a retryable internal error of that request (a failed KV load, say). It once
# reached clients as an empty answer that looked complete; it is a failure the router migrates.
_RETRYABLE_ERROR = "error"
_NO_DISAGGREGATION = "this vLLM worker runs without a KV connector: only prefill and decode workers move KV"
_MAX_SEED = (1 << 63) - 1


def step_timing_logger(fit: TimingFit, transfers: TransferStats) -> Callable[..., Any]:
    """A vLLM stat logger factory that feeds every engine step the core timed into ``fit`` (its
    prefill tokens, whether it decoded, its elapsed ms, and the KV cache usage standing in for the
    model's decoding-context share) and what its KV connector pulled into ``transfers``."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class StepTimingLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.steps = 0

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0):
            connector = getattr(scheduler_stats, "kv_connector_stats", None)
            if isinstance(connector, dict):
                record_connector_stats(connector, transfers)
            details = getattr(scheduler_stats, "iteration_details", None)
            if details is None or details.is_dummy or details.elapsed_ms <= 0:
                return
            decoding = details.num_generation_requests > 0
            usage = float(getattr(scheduler_stats, "kv_cache_usage", 0.0))  # already a share of the capacity
            if fit.observe(details.num_ctx_tokens, usage, 1.0, decoding, details.elapsed_ms):
                self.steps += 1

        def log_engine_initialized(self) -> None:
            pass

    return StepTimingLogger


def kv_bytes_per_block(vllm_config: Any) -> int:
    """Bytes of KV one block holds (K and V, every layer), to report what a transfer moved; 0 where
    the model's shape cannot be read."""
    try:
        model, parallel, cache = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
        per_token = 2 * model.get_num_layers(parallel) * model.get_num_kv_heads(parallel) * model.get_head_size()
        return per_token * model.dtype.itemsize * cache.block_size
    except Exception:
        return 0


def record_connector_stats(stats: dict[str, Any], transfers: TransferStats) -> None:
    """vLLM's NIXL connector stats of one interval (lists of per-transfer figures) into ours."""
    durations = stats.get("transfer_duration") or []
    moved = stats.get("bytes_transferred") or []
    if moved:
        transfers.count(transfers.bytes_received, "nixl", int(sum(moved)))
        transfers.count(transfers.pulls, "ok", len(moved))
    if durations:
        transfers.count(transfers.pull_seconds, "nixl", float(sum(durations)))
    failed = len(stats.get("num_failed_transfers") or []) + len(stats.get("num_failed_handshakes") or [])
    if failed:
        transfers.count(transfers.pulls, "failed", failed)


class VllmEngineArgsError(ValueError):
    """vLLM's argument parser rejected the engine arguments; the message is its own."""


def engine_args(argv: Sequence[str], overrides: dict[str, Any], engines: int = 1) -> Any:
    """``AsyncEngineArgs`` from vLLM's own flags, then the worker's shared options (``overrides``,
    None entries left to vLLM), prefix caching on, and the tiny model when no ``--model`` is given.
    ``engines``: the engine cores this worker runs (its data-parallel ranks), which share its host."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="kvmesh worker --engine vllm", exit_on_error=False)
    AsyncEngineArgs.add_cli_args(parser)
    if vllm_defaults.cpu_build():
        # a worker started alone takes the CPU build's defaults as the only worker on its host
        # (`kvmesh up` has chosen them already for the engines it starts: then none is left out)
        chosen = vllm_defaults.cpu_defaults(argv, engines, vllm_defaults.available_memory())
        if chosen:
            log.info("vLLM's CPU build: chose what was not given", chose=vllm_defaults.describe(chosen))
            argv = [*argv, *vllm_defaults.as_argv(chosen)]
    try:
        namespace = parser.parse_args(list(argv))
    except (SystemExit, Exception) as exc:
        raise VllmEngineArgsError(f"invalid vLLM engine arguments {list(argv)}: {exc}") from None
    args = AsyncEngineArgs.from_cli_args(namespace)
    if not any(a == "--model" or a.startswith("--model=") for a in argv):
        args.model = str(tiny_llama.ensure())
        args.tokenizer = args.model
    for name, value in overrides.items():
        if value is not None:
            setattr(args, name, value)
    args.enable_prefix_caching = True
    return args


class VllmEngine(StreamingEngine):
    """Guarantees beyond :class:`StreamingEngine`'s: a request cancelled by its caller is aborted in vLLM
    (its blocks freed); a request vLLM fails ends its queue with an :class:`EngineFailure`."""

    no_transfer_reason = "a vLLM worker's KV moves through vLLM's connector, not the worker's transfer server"

    def __init__(
        self,
        argv: Sequence[str],
        overrides: dict[str, Any],
        deliver_events: Callable[[list[EventData]], None],
        last_event_id: Callable[[], int],
        kv_connector_host: str | None = None,
        tier_publishers: Mapping[str, Publisher] | None = None,
        lora_paths: Mapping[str, str] | None = None,
        rank_publishers: Sequence[tuple[Publisher, Mapping[str, Publisher]]] = (),
    ) -> None:
        """``kv_connector_host``: set for prefill and decode workers, which move KV with vLLM's NIXL
        connector; its side channel listens there (on a free port). ``tier_publishers``: per
        offloaded tier (``host``, ``disk``), where its events go and the last event id numbered there
        (an offloading connector's CPU and disk blocks are relayed with their medium). ``lora_paths``:
        each LoRA adapter's directory, by name (vLLM loads one on its first request).
        ``rank_publishers``: for data-parallel ranks 1, 2, ..., where each one's events go and the last
        event id numbered there, and its own offloaded tiers' the same; vLLM runs
        ``1 + len(rank_publishers)`` ranks (this engine is rank 0)."""
        self.tiers = OffloadedTiers(tier_publishers)
        super().__init__(last_event_id)
        self._argv = list(argv)
        # vLLM tells adapters apart by a positive integer id as well as their name
        self._lora_requests = {
            name: (name, index, path) for index, (name, path) in enumerate((lora_paths or {}).items(), start=1)
        }
        self._connector_host = kv_connector_host
        self._overrides = overrides
        self._deliver_events = deliver_events
        self._llm: Any = None
        self._relay: VllmEventRelay | None = None
        # vLLM's steps as the engine core timed them; the prior is the mock's model until steps arrive
        self.timing_fit = TimingFit(TimingModel())
        # what vLLM's KV connector reports it pulled (bytes, seconds), for the worker's metrics
        self.transfer_stats = TransferStats()
        self.max_num_batched_tokens = 0
        self.model = ""
        self.connector_backend = ""
        self.kv_bytes_per_block = 0
        self.ranks = [
            VllmRank(self, rank, deliver, last, OffloadedTiers(tiers))
            for rank, ((deliver, last), tiers) in enumerate(rank_publishers, 1)
        ]

    async def start(self) -> None:
        from vllm.config import KVEventsConfig
        from vllm.v1.engine.async_llm import AsyncLLM

        args = await asyncio.to_thread(engine_args, self._argv, self._overrides, 1 + len(self.ranks))
        # the engine binds the replay port (and the side channel's) only after loading its model;
        # rank r publishes on each port plus r
        events_port, replay_port = free_port_run(1 + len(self.ranks)), free_port_run(1 + len(self.ranks))
        # bound before the engine starts, so its publisher's first batch finds us
        self._relay = VllmEventRelay(
            f"tcp://127.0.0.1:{events_port}",
            f"tcp://127.0.0.1:{replay_port}",
            self._translator,
            self._deliver_events,
            self.tiers.relays(),
        )
        for rank in self.ranks:
            rank.relay = VllmEventRelay(
                f"tcp://127.0.0.1:{events_port + rank.rank}",
                f"tcp://127.0.0.1:{replay_port + rank.rank}",
                rank.translator,
                rank.deliver_events,
                rank.tiers.relays(),
            )
        if self.ranks:
            args.data_parallel_size = 1 + len(self.ranks)
        args.kv_events_config = KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=self._relay.sub_endpoint,
            replay_endpoint=self._relay.replay_endpoint,
        )
        if self._connector_host is not None:
            self._configure_connector(args)
        await self._relay.start()
        for rank in self.ranks:
            assert rank.relay is not None
            await rank.relay.start()
        # per-step details (prefill tokens, decoding requests, elapsed ms) feed the timing fit; vLLM's
        # own stat logger would print each of them, so its periodic lines are all it keeps
        args.disable_log_stats = False
        args.enable_logging_iteration_details = True
        logging.getLogger("vllm.v1.metrics.loggers").setLevel(logging.WARNING)
        log.info("starting vLLM", model=args.model, block_size=args.block_size)
        logger = step_timing_logger(self.timing_fit, self.transfer_stats)
        self._llm = AsyncLLM.from_engine_args(args, stat_loggers=[logger])
        config = self._llm.vllm_config
        self.block_size = config.cache_config.block_size
        self.num_blocks = config.cache_config.num_gpu_blocks or 0
        self.max_model_len = config.model_config.max_model_len
        self.max_num_batched_tokens = config.scheduler_config.max_num_batched_tokens
        self.kv_bytes_per_block = kv_bytes_per_block(config)
        self.model = args.model
        from vllm.platforms import current_platform

        parallel = config.parallel_config
        self.speed_class = (  # engines alike in these share one speed in the routers' cost (decision 62)
            f"vllm {current_platform.get_device_name()} {config.model_config.dtype} "
            f"tp{parallel.tensor_parallel_size} pp{parallel.pipeline_parallel_size}"
        )
        for rank in self.ranks:  # every rank an engine core of the same shape
            rank.block_size, rank.num_blocks, rank.max_model_len = self.block_size, self.num_blocks, self.max_model_len
        log.info(
            "vLLM ready",
            model=self.model,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            max_model_len=self.max_model_len,
        )

    def _configure_connector(self, args: Any) -> None:
        """vLLM's NIXL connector, both roles, its KV buffer in host memory on a CPU build and on the
        device elsewhere. Its side channel's address is read from the environment by the engine core
        process, which inherits ours when it starts."""
        from vllm.config import KVTransferConfig
        from vllm.platforms import current_platform

        host = self._connector_host or "127.0.0.1"
        os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = host
        # vLLM's listener fails in a thread of its own when this port is taken, and its engine then
        # waits for it forever: hence a port the kernel does not hand out meanwhile
        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port(host))
        # read by kvmesh's vLLM plugin in the engine's own processes: NIXL without its spinning thread
        os.environ[QUIET_NIXL_ENV] = "1"
        device = "cpu" if current_platform.is_cpu() else current_platform.device_type
        # A decode whose pull fails computes the prompt itself: slower, never an error for the client.
        args.kv_transfer_config = KVTransferConfig(
            kv_connector="NixlConnector",
            kv_role="kv_both",
            kv_buffer_device=device,
            kv_load_failure_policy="recompute",
        )
        self.connector_backend = "nixl"

    async def stop(self) -> None:
        await self._end_requests()
        for rank in self.ranks:
            await rank.stop()
        if self._llm is not None:
            self._llm.shutdown()
        if self._relay is not None:
            await self._relay.stop()
        for rank in self.ranks:
            if rank.relay is not None:
                await rank.relay.stop()

    # ---- requests ----------------------------------------------------------------------------
    def submit(
        self, spec: EngineRequestSpec, hold_on_finish: bool = False, kv_transfer_params: dict[str, Any] | None = None
    ) -> TokenQueue:
        if (hold_on_finish or kv_transfer_params) and not self.connector_backend:
            raise EngineRequestError(_NO_DISAGGREGATION)
        if hold_on_finish:  # a prefill for another worker: vLLM keeps its blocks for the decode side's pull
            kv_transfer_params = {"do_remote_decode": True}
        return self._run(spec, lambda queue: self._generate(spec, queue, kv_transfer_params))

    def submit_to_rank(self, engine: StreamingEngine, spec: EngineRequestSpec, rank: int) -> TokenQueue:
        """A whole request on data-parallel rank ``rank``, tracked by ``engine`` (that rank's view)."""
        return engine._run(spec, lambda queue: self._generate(spec, queue, None, rank))

    def _sampling_params(self, spec: EngineRequestSpec, kv_transfer_params: dict[str, Any] | None) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        options: dict[str, Any] = {
            "max_tokens": spec.max_tokens,
            "stop_token_ids": list(spec.stop_token_ids),
            "ignore_eos": spec.ignore_eos,
            "output_kind": RequestOutputKind.DELTA,
        }
        if spec.temperature is not None:
            options["temperature"] = spec.temperature
        if spec.top_p is not None:
            options["top_p"] = spec.top_p
        if spec.seed is not None:
            options["seed"] = spec.seed & _MAX_SEED
        if kv_transfer_params:
            options["extra_args"] = {"kv_transfer_params": kv_transfer_params}
        return SamplingParams(**options)

    def _lora_request(self, adapter: str) -> Any:
        """vLLM's request for ``adapter``; the worker refused any adapter it does not serve before this."""
        from vllm.lora.request import LoRARequest

        name, lora_id, path = self._lora_requests[adapter]
        return LoRARequest(name, lora_id, path)

    async def _generate(
        self, spec: EngineRequestSpec, queue: TokenQueue, kv_transfer_params: dict[str, Any] | None, rank: int = 0
    ) -> None:
        prompt = {"prompt_token_ids": list(spec.prompt)}
        cached = 0
        try:
            # cancelling this task cancels the generator, which aborts the request in vLLM
            sampling = self._sampling_params(spec, kv_transfer_params)
            # only what is set: vLLM's defaults otherwise (an engine client without LoRA or ranks)
            extra: dict[str, Any] = {}
            if spec.lora_name is not None:
                extra["lora_request"] = self._lora_request(spec.lora_name)
            if self.ranks:
                extra["data_parallel_rank"] = rank
            async for output in self._llm.generate(prompt, sampling, spec.request_id, **extra):
                cached = output.num_cached_tokens or cached
                completion = output.outputs[0]
                tokens = list(completion.token_ids)
                if output.finished and completion.finish_reason == _RETRYABLE_ERROR:
                    queue.put_nowait(EngineFailure("vLLM failed the request (a retryable internal error)"))
                    return
                finish = _FINISH.get(completion.finish_reason) if output.finished else None
                if output.finished and finish is None:
                    finish = FinishReason.STOP
                handoff = output.kv_transfer_params if output.finished else None
                for i, token in enumerate(tokens):
                    last = i == len(tokens) - 1
                    queue.put_nowait(
                        TokenOutput(spec.request_id, token, finish if last else None, cached, handoff if last else None)
                    )
                if output.finished and not tokens:  # finished without a new token
                    queue.put_nowait(TokenOutput(spec.request_id, None, finish, cached, handoff))
                if output.finished:
                    return
            # the outputs ended without a finished one: the caller must not wait for more
            queue.put_nowait(EngineFailure("vLLM ended the request's outputs without finishing it"))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.error("vLLM request failed", request_id=spec.request_id, error=f"{type(exc).__name__}: {exc}")
            queue.put_nowait(EngineFailure(f"the vLLM engine failed the request: {type(exc).__name__}: {exc}"))

    # ---- state -------------------------------------------------------------------------------
    def fitted_timing(self) -> TimingModel | None:
        return self.timing_fit.model() if self.timing_fit.observations else None

    def timing_evidence(self) -> TimingEvidence | None:
        return self.timing_fit.evidence() if self.timing_fit.observations else None

    def dump_tier_state(self, tier: str) -> tuple[int, list[CachedBlock]] | None:
        """The relay's view of the blocks rank 0 offloaded to ``tier`` (``host``: CPU memory, ``disk``)."""
        return self.tiers.dump(tier)

    @property
    def relay(self) -> VllmEventRelay | None:
        return self._relay


class VllmRank(StreamingEngine):
    """Data-parallel rank ``rank`` (1 or more) of a :class:`VllmEngine`, as an engine of its own for the
    worker: its requests run on that rank's engine core, and its cache is what that rank's KV events
    say (relayed, as dp rank ``rank``, by ``relay``, which the engine starts and stops)."""

    no_transfer_reason = VllmEngine.no_transfer_reason

    def __init__(
        self,
        engine: VllmEngine,
        rank: int,
        deliver_events: Callable[[list[EventData]], None],
        last_event_id: Callable[[], int],
        tiers: OffloadedTiers | None = None,
    ) -> None:
        super().__init__(last_event_id)
        self.engine = engine
        self.rank = rank
        self.tiers = tiers or OffloadedTiers(None)
        self.deliver_events = deliver_events
        self.translator = self._translator
        self.relay: VllmEventRelay | None = None

    async def start(self) -> None:
        return None  # started with its engine

    async def stop(self) -> None:
        await self._end_requests()

    def submit(
        self, spec: EngineRequestSpec, hold_on_finish: bool = False, kv_transfer_params: dict[str, Any] | None = None
    ) -> TokenQueue:
        if hold_on_finish or kv_transfer_params:
            raise EngineRequestError(_NO_DISAGGREGATION)
        return self.engine.submit_to_rank(self, spec, self.rank)

    def dump_tier_state(self, tier: str) -> tuple[int, list[CachedBlock]] | None:
        """The relay's view of the blocks this rank offloaded to ``tier``."""
        return self.tiers.dump(tier)
