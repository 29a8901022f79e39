"""Frontend configuration: one typed object, from flags and ``KVMESH_*`` environment variables."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.common.core.tiny_model import MODEL_DIR, MODEL_NAME
from kvmesh.common.runtime.config import CommonConfig, ConfigError, option


@dataclass
class HttpApiOptions:
    """HTTP API: where it listens, the model it serves, its limits.

    Declared once: ``kvmesh frontend`` takes them, and so does ``kvmesh up``, which hands them to its
    frontend (a secret one through the environment, never the command line)."""

    http_host: str = option("127.0.0.1", "address the HTTP server binds")
    http_port: int = option(8000, "HTTP port of the OpenAI-compatible API")
    model_name: str = option(MODEL_NAME, "model name clients use in `model`")
    model_path: str = option(str(MODEL_DIR), "model directory with tokenizer.json and tokenizer_config.json")
    api_key: str | None = option(
        None,
        "API keys clients must send as 'Authorization: Bearer <key>' (comma-separated; default: none needed)",
        secret=True,
    )
    api_key_file: str | None = option(None, "file of API keys, one per line (with or instead of --api-key)")
    max_concurrent_requests: int = option(
        0, "requests in flight at once; one more is a 503 with Retry-After (0: no limit)"
    )


@dataclass
class FrontendConfig(CommonConfig, HttpApiOptions):
    router_address: str | None = option(None, "fixed router host:port (default: discover routers over NATS)")
    default_max_tokens: int = option(64, "max_tokens when a request gives none")
    load_report_secs: float = option(5.0, "seconds between the load reports published for the planner")
    max_request_body_bytes: int = option(32 * 1024 * 1024, "larger request bodies are refused with a 413 (0: no limit)")
    ext_proc_port: int = option(
        -1,
        "also serve Envoy's external processing (ext_proc) on this port, on --http-host, as an endpoint picker "
        "for a Gateway API Inference Extension gateway: it names the chosen worker's --gateway-endpoint in "
        "x-gateway-destination-endpoint (-1: off; 0: a free port)",
    )

    def validate(self) -> None:
        if not 0 <= self.http_port < 65536:
            raise ConfigError("--http-port must be between 0 and 65535")
        if self.default_max_tokens <= 0:
            raise ConfigError("--default-max-tokens must be positive")
        if self.load_report_secs <= 0:
            raise ConfigError("--load-report-secs must be positive")
        if self.max_request_body_bytes < 0:
            raise ConfigError("--max-request-body-bytes must be >= 0")
        if not -1 <= self.ext_proc_port < 65536:
            raise ConfigError("--ext-proc-port must be -1 (off) or a port between 0 and 65535")
        if self.max_concurrent_requests < 0:
            raise ConfigError("--max-concurrent-requests must be >= 0")
