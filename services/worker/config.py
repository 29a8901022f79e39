"""Worker configuration: one typed object, from flags and ``KVMESH_*`` environment variables."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from kvmesh.common.runtime.config import ConfigError, GrpcEndpointConfig, option
from kvmesh.common.wire.disagg import default_kv_handoff
from kvmesh.common.wire.kv_events import parse_moe_placements
from kvmesh.common.wire.lora import adapter_paths
from kvmesh.worker.engines.vllm.vllm_defaults import check_block_size

GATEWAY_ENDPOINT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):\d{1,5}")

DEFAULT_MODEL_NAME = "kvmesh-tiny"
# The mock engine's shape where a flag is not given (vLLM picks its own).
MOCK_DEFAULTS = {"block_size": 16, "num_gpu_blocks": 16384, "max_num_seqs": 256, "max_num_batched_tokens": 8192}


def check_lora_adapters(options: EngineOptions) -> None:
    """``--lora-adapters``, ``--max-loras`` and ``--lora-load-ms``, for ``kvmesh worker`` and
    ``kvmesh up`` alike."""
    try:
        paths = adapter_paths(options.lora_adapters)
    except ValueError as exc:
        raise ConfigError(f"--lora-adapters: {exc}") from None
    if options.max_loras < 0 or options.lora_load_ms < 0:
        raise ConfigError("--max-loras and --lora-load-ms must be >= 0")
    if options.engine == "vllm":
        missing = [name for name, path in paths.items() if not path]
        if missing:
            raise ConfigError(
                f"--lora-adapters: an in-process vLLM loads each adapter from a directory: NAME=PATH "
                f"({', '.join(missing)} has none)"
            )
        absent = [path for path in paths.values() if path and not Path(path).is_dir()]
        if absent:
            raise ConfigError(f"--lora-adapters: no adapter directory at {', '.join(map(str, absent))}")
    elif options.engine == "served" and any(paths.values()):
        raise ConfigError(
            "--lora-adapters: a served engine loads its adapters itself (vLLM: --lora-modules NAME=PATH); "
            "give the names it serves them under"
        )


def check_data_parallel(options: EngineOptions, role: str = "aggregated") -> None:
    """``--data-parallel-size``, for ``kvmesh worker`` and ``kvmesh up`` alike (``role``: the
    worker's, or with ``kvmesh up`` whether it starts prefill workers)."""
    size = options.data_parallel_size
    if size < 1:
        raise ConfigError("--data-parallel-size must be at least 1")
    if size > 1 and options.engine not in ("mock", "vllm"):
        raise ConfigError(
            "--data-parallel-size: the mock engine simulates ranks and vLLM runs them (not --engine served)"
        )
    if size > 1 and (role != "aggregated" or getattr(options, "kv_pool", None) or options.host_kv_blocks):
        raise ConfigError(
            "--data-parallel-size above 1 is for aggregated workers without --kv-pool or --host-kv-blocks"
        )


def check_served_engine(config: WorkerConfig) -> None:
    """``--engine served`` and its options."""
    served_options = config.engine_url or config.engine_kv_events or config.engine_kv_replay
    if config.engine != "served":
        if served_options:
            raise ConfigError("--engine-url, --engine-kv-events and --engine-kv-replay go with --engine served")
        return
    if not config.engine_url or not config.engine_url.startswith(("http://", "https://")):
        raise ConfigError("--engine served needs --engine-url, the server's OpenAI base (http://host:port/v1)")
    if config.role != "aggregated":
        raise ConfigError("--engine served fronts whole requests only (its KV connector is not driven from here)")
    if config.engine_kv_replay and not config.engine_kv_events:
        raise ConfigError("--engine-kv-replay goes with --engine-kv-events")
    if config.engine_args:
        raise ConfigError(f"unrecognized arguments: {' '.join(config.engine_args)} (the server has its own)")


def check_host_tier(options: EngineOptions) -> None:
    """The host tier's options, for ``kvmesh worker`` and ``kvmesh up`` alike."""
    if options.host_kv_blocks < 0 or options.host_reload_ms_per_token < 0:
        raise ConfigError("--host-kv-blocks and --host-reload-ms-per-token must be >= 0")
    if options.host_kv_blocks and options.engine != "mock":
        raise ConfigError("--host-kv-blocks is the mock engine's (vLLM offloads with its own connector)")


@dataclass
class MockEngineOptions:
    """Engine, mock: the simulated engine's speed, model shape and host tier."""

    speedup_ratio: float = option(1.0, "divide simulated step times by this (>1 runs faster than real)")
    num_layers: int = option(2, "model shape for the KV buffer: layers")
    host_kv_blocks: int = option(
        0,
        "mock engine: a host-memory tier of this many blocks takes the blocks evicted from the device and reloads "
        "them for a later request, at --host-reload-ms-per-token (its events are tier `host`; 0: no host tier)",
    )
    host_reload_ms_per_token: float = option(
        0.002, "mock engine: simulated time to reload a token's KV from the host tier (before --speedup-ratio)"
    )


@dataclass
class LoraOptions:
    """Engine, LoRA adapters: which it serves and how many it holds loaded."""

    lora_adapters: str = option(
        "",
        "LoRA adapters this worker serves, comma-separated NAME or NAME=PATH; a request names one as its model "
        "and the router sends it only to workers that serve it. The mock engine simulates them (an adapter's KV "
        "blocks are its own); --engine vllm loads each from its PATH (a PEFT directory); with --engine served, "
        "the names the engine server loaded them under",
    )
    max_loras: int = option(
        0,
        "LoRA adapters loaded at once (0: all of --lora-adapters); a request for another loads it first, "
        "evicting the least recently used, and the routers charge a worker that must load an adapter for it "
        "(--lora-load-tokens). vLLM: its max_loras and max_cpu_loras",
    )
    lora_load_ms: float = option(
        50.0, "the mock engine's simulated time to load a LoRA adapter that is not loaded (see --max-loras)"
    )


@dataclass
class DataParallelOptions:
    """Engine, data parallelism: ranks of one worker, each with a KV cache of its own."""

    data_parallel_size: int = option(
        1,
        "data-parallel ranks this worker runs, each an engine with a KV cache of its own that publishes its events "
        "as its dp rank; the router chooses a (worker, rank). The mock engine simulates them; with --engine vllm "
        "they are vLLM's data-parallel engine cores. Aggregated workers only (the mock's without --kv-pool or "
        "--host-kv-blocks)",
    )


@dataclass
class KvHandoffOptions:
    """Engine, KV handoff: how a prefill's KV reaches its decode worker."""

    kv_handoff: str | None = option(
        None,
        "how this engine's prefills meet their decode workers, which the router follows: bootstrap (the decode "
        "half leaves at once and pulls the KV from a rendezvous) or sync (the router waits for the prefill's "
        "answer and passes its KV parameters on). Default: the engine's own (mock: bootstrap; vLLM, whose KV "
        "connector hands out its parameters only once the prefill ran: sync, the only one it can do)",
        choices=("bootstrap", "sync"),
    )
    kv_transfer_backend: str = option(
        "auto",
        "how KV moves between prefill and decode workers: NIXL (UCX, DRAM; needs the nixl extra), "
        "built-in TCP, or auto (NIXL when installed, for prefill and decode roles)",
        choices=("auto", "nixl", "tcp"),
    )


@dataclass
class CacheMoveOptions:
    """Engine, cache moves: the cache kept when the fleet changes.

    The mock engine's, and the replay's virtual workers' (docs/decisions/0051)."""

    shrink_handoff_blocks: int = option(
        0,
        "a worker that leaves (stopped, or removed by the planner, which then picks the one whose departure "
        "loses fewest cached blocks no other worker holds) first sends its hottest cached blocks, up to this "
        "many with their prefixes, to the workers that stay, over the KV transfer; 0: it leaves with its cache",
    )
    join_warmup_blocks: int = option(
        0,
        "a worker that starts first imports up to this many of the fleet's hottest cached blocks (those of the "
        "busiest workers of its role, with their prefixes) over the KV transfer, and only then takes requests; "
        "0: it starts cold",
    )
    join_warmup_secs: float = option(
        10.0, "with --join-warmup-blocks: the most seconds a worker spends importing before it takes requests"
    )

    def check_cache_moves(self) -> None:
        if self.shrink_handoff_blocks < 0 or self.join_warmup_blocks < 0:
            raise ConfigError("--shrink-handoff-blocks and --join-warmup-blocks must be 0 (off) or positive")
        if self.join_warmup_secs <= 0:
            raise ConfigError("--join-warmup-secs must be positive")


@dataclass
class EngineOptions(MockEngineOptions, LoraOptions, DataParallelOptions, KvHandoffOptions, CacheMoveOptions):
    """Engine: which one, and its KV cache's shape.

    The engine options every worker of a mesh shares, declared once with their sub-groups above:
    ``kvmesh worker`` takes them, and so does ``kvmesh up``, which hands them to each worker it starts."""

    engine: str = option(
        "mock",
        "inference engine: the simulated mock, vLLM in-process (vLLM's own engine arguments such as --model, "
        "--max-model-len or --gpu-memory-utilization follow the worker's flags and go to vLLM), or served: an "
        "OpenAI-compatible engine server already running at --engine-url (vllm serve, SGLang's server)",
        choices=("mock", "vllm", "served"),
    )
    block_size: int | None = option(
        None, f"tokens per KV block (default: {MOCK_DEFAULTS['block_size']} for the mock, vLLM's own)"
    )
    num_gpu_blocks: int | None = option(
        None,
        f"KV blocks in the cache (default: {MOCK_DEFAULTS['num_gpu_blocks']} for the mock; vLLM sizes its own)",
        flag="--num-gpu-blocks-override",
    )


@dataclass
class WorkerConfig(GrpcEndpointConfig, EngineOptions):
    kv_events_flush_ms: float = option(
        5.0,
        "KV events wait up to this long for the next ones before they are published, so that one stream "
        "message carries several engine steps' events (0: publish each step's at once)",
    )
    kv_events_max_age: float = option(
        3600.0, "seconds the KV event stream keeps a message, if this process creates the stream"
    )
    role: str = option(
        "aggregated",
        "worker role, part of its registration; routers never send whole requests to prefill workers",
        choices=("aggregated", "prefill", "decode"),
    )
    model_name: str = option(DEFAULT_MODEL_NAME, "model name served (what clients put in `model`)")
    max_num_seqs: int | None = option(
        None, f"most sequences running at once (default: {MOCK_DEFAULTS['max_num_seqs']})"
    )
    max_num_batched_tokens: int | None = option(
        None, f"token budget of one engine step, chunked prefill (default: {MOCK_DEFAULTS['max_num_batched_tokens']})"
    )
    engine_url: str | None = option(
        None, "with --engine served: the engine server's OpenAI base URL (e.g. http://127.0.0.1:8100/v1)"
    )
    gateway_endpoint: str | None = option(
        None,
        "host:port a Gateway API Inference Extension gateway sends this worker's requests to: its model "
        "server's OpenAI API, named by kvmesh's endpoint picker (frontend --ext-proc-port); default with "
        "--engine served: --engine-url's host and port",
    )
    pod_name: str = option(
        "",
        "the Kubernetes pod this worker runs in (the manifests set it from the downward API's metadata.name), "
        "named in its discovery record: the planner's --kubernetes-departure-blocks marks each pod with what "
        "its departure loses, so that a shrink stops the one that loses least",
    )
    engine_kv_events: str | None = option(
        None,
        "with --engine served: the ZMQ endpoint where the server publishes its KV events (vLLM: the endpoint of "
        "its --kv-events-config, e.g. tcp://127.0.0.1:5557); without it the indexers never learn its cache",
    )
    engine_kv_replay: str | None = option(
        None, "with --engine served: the server's KV event replay endpoint (vLLM: replay_endpoint), to fill gaps"
    )
    kv_pool: str = option(
        "",
        "mock engine: a host KV pool directory (e.g. /dev/shm/kvmesh-pool): this worker writes every block it "
        "computes into its own shared-memory segment there and imports blocks it lacks from every segment there",
    )
    kv_pool_blocks: int = option(4096, "blocks this worker's KV pool segment holds (least recently written go first)")
    moe_experts: str = option(
        "",
        "mock engine, as a mixture-of-experts model: the experts this worker hosts, layer:expert[:group] comma-"
        "separated (e.g. 0:3,1:7); its KV events tag every cached block with them",
    )
    num_kv_heads: int = option(2, "model shape for the KV buffer: KV heads")
    head_dim: int = option(32, "model shape for the KV buffer: head dimension")
    kv_dtype_bytes: int = option(2, "model shape for the KV buffer: bytes per element")
    kv_transfer_port: int = option(0, "port of the KV transfer server (0: a free port, advertised in discovery)")
    kv_transfer_timeout_secs: float = option(
        30.0, "decode side: longest wait for a prefill's KV (rendezvous plus transfer) before prefilling locally"
    )
    disagg_hold_timeout_secs: float = option(
        30.0, "prefill side: release a finished prefill's KV if no decode worker has taken it by then"
    )

    timing_advertise_secs: float = option(
        5.0,
        "seconds between updates of the step-time constants this worker fitted, and of the steps behind them, "
        "which it advertises to the routers",
    )
    speed_class: str | None = option(
        None,
        "what this worker's engine has in common with the equally fast (routers cost a model's workers of one "
        "class at one speed, fitted to their steps together; default: the engine and its device, e.g. "
        "'vllm cpu torch.float32 tp1 pp1'; name the host kind where hosts differ)",
    )
    engine_args: list[str] = option(
        None, "with --engine vllm: the arguments the worker does not know itself, handed to vLLM", passthrough=True
    )

    def resolved_kv_handoff(self) -> str:
        """The way this worker's prefills meet their decode workers (advertised in discovery)."""
        return self.kv_handoff or default_kv_handoff(self.engine)

    def validate(self) -> None:
        check_host_tier(self)
        if self.gateway_endpoint is not None and GATEWAY_ENDPOINT.fullmatch(self.gateway_endpoint) is None:
            raise ConfigError(
                f"--gateway-endpoint {self.gateway_endpoint!r}: give host:port (an IPv6 host in brackets)"
            )
        if self.engine == "vllm" and self.kv_handoff == "bootstrap":
            raise ConfigError("--kv-handoff bootstrap is the mock engine's; vLLM's KV connector needs sync")
        for name, flag in (
            ("block_size", "--block-size"),
            ("num_gpu_blocks", "--num-gpu-blocks-override"),
            ("max_num_seqs", "--max-num-seqs"),
            ("max_num_batched_tokens", "--max-num-batched-tokens"),
        ):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"{flag} must be positive")
        if self.speedup_ratio <= 0 or self.timing_advertise_secs <= 0:
            raise ConfigError("--speedup-ratio and --timing-advertise-secs must be positive")
        if self.engine == "mock" and self.engine_args:
            raise ConfigError(
                f"unrecognized arguments: {' '.join(self.engine_args)} (engine arguments need --engine vllm)"
            )
        try:
            parse_moe_placements(self.moe_experts)
        except ValueError as exc:
            raise ConfigError(f"--moe-experts: {exc}") from None
        if self.kv_pool and self.engine != "mock":
            raise ConfigError("--kv-pool is the mock engine's (vLLM manages its own KV memory)")
        if self.kv_events_flush_ms < 0:
            raise ConfigError("--kv-events-flush-ms must be >= 0")
        if self.kv_pool_blocks < 8:
            raise ConfigError("--kv-pool-blocks must be at least 8")
        if self.moe_experts and self.engine != "mock":
            raise ConfigError("--moe-experts tags the mock engine's blocks (vLLM publishes its own events)")
        if min(self.num_layers, self.num_kv_heads, self.head_dim, self.kv_dtype_bytes) <= 0:
            raise ConfigError("--num-layers, --num-kv-heads, --head-dim and --kv-dtype-bytes must be positive")
        if self.kv_transfer_timeout_secs <= 0 or self.disagg_hold_timeout_secs <= 0:
            raise ConfigError("--kv-transfer-timeout-secs and --disagg-hold-timeout-secs must be positive")
        check_lora_adapters(self)
        check_data_parallel(self, self.role)
        check_served_engine(self)
        self.check_cache_moves()
        if (self.shrink_handoff_blocks or self.join_warmup_blocks) and self.engine != "mock":
            raise ConfigError("--shrink-handoff-blocks and --join-warmup-blocks move the mock engine's blocks")
        if self.engine == "vllm":
            check_block_size(self.block_size)

    def resolved_transfer_backend(self) -> str:
        """The backend this worker uses. Aggregated workers never serve a prefill for another worker,
        so ``auto`` spares them NIXL's start-up; they can still receive KV over TCP."""
        from kvmesh.worker.kv_transfer.nixl_agent import nixl_available

        if self.kv_transfer_backend == "nixl":
            if not nixl_available():
                raise ConfigError(
                    "--kv-transfer-backend nixl needs the nixl extra: pip install torch==2.13.0 && "
                    'pip install -e ".[nixl]"'
                )
            return "nixl"
        if self.kv_transfer_backend == "auto" and self.role != "aggregated" and nixl_available():
            return "nixl"
        return "tcp"

    def mock_shape(self, name: str) -> int:
        """The mock engine's value of a shape option (``block_size``, ``num_gpu_blocks``, ...)."""
        value = getattr(self, name)
        return MOCK_DEFAULTS[name] if value is None else value
