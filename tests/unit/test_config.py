import socket
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from kvmesh.common.runtime.config import CommonConfig, ConfigError, advertised_host, option, parse_config


@dataclass
class SampleConfig(CommonConfig):
    port: int = option(0, "a port")
    ratio: float = option(1.0, "a ratio")
    enabled: bool = option(False, "a switch")
    name: str | None = option(None, "an optional name")

    def validate(self) -> None:
        if self.ratio <= 0:
            raise ConfigError("--ratio must be positive")


def parse(argv, env=None):
    return parse_config(SampleConfig, argv, prog="t", description="d", environ=env or {})


def test_defaults():
    config = parse([])
    assert (config.port, config.ratio, config.enabled, config.name) == (0, 1.0, False, None)
    assert config.nats_url.startswith("nats://")


def test_environment_then_flags_take_precedence():
    env = {"KVMESH_PORT": "9000", "KVMESH_ENABLED": "true", "KVMESH_NAME": "env"}
    assert (parse([], env).port, parse([], env).enabled, parse([], env).name) == (9000, True, "env")
    config = parse(["--port", "9100", "--no-enabled"], env)
    assert (config.port, config.enabled) == (9100, False)


def test_bad_values_exit_with_a_clear_message(capsys):
    with pytest.raises(SystemExit):
        parse(["--ratio", "0"])
    assert "--ratio must be positive" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse([], {"KVMESH_PORT": "eighty"})
    assert "KVMESH_PORT" in capsys.readouterr().err


@pytest.mark.parametrize("namespace", ["a.b", "team a", "a*", "", "x" * 65])
def test_a_namespace_that_cannot_name_subjects_and_durables_is_refused(namespace, capsys):
    with pytest.raises(SystemExit):
        parse(["--namespace", namespace])
    assert "--namespace" in capsys.readouterr().err
    assert parse(["--namespace", "team-a_2"]).namespace == "team-a_2"


def test_help_names_the_environment_variable(capsys):
    with pytest.raises(SystemExit):
        parse(["--help"])
    assert "KVMESH_RATIO" in capsys.readouterr().out


def test_router_options_are_declared_once_and_handed_on_unchanged():
    """`kvmesh up` takes every router option and passes it to its routers as flags."""
    from kvmesh.common.runtime.config import options_argv
    from kvmesh.router.config import RouterConfig, RouterOptions
    from kvmesh.up.config import UpConfig

    flags = ["--router-mode", "round-robin", "--no-kv-events", "--kv-overlap-score-weight", "0.25"]
    flags += ["--active-decode-blocks-threshold", "7", "--enforce-disagg", "--no-track-active-blocks"]
    flags += ["--prefill-policy", "cache-aware", "--decode-policy", "power-of-two", "--cache-threshold", "0.6"]
    up = parse_config(UpConfig, flags, prog="up", description="", environ={})
    router = parse_config(RouterConfig, options_argv(RouterOptions, up), prog="r", description="", environ={})
    for name in ("router_mode", "kv_events", "kv_overlap_score_weight", "active_decode_blocks_threshold"):
        assert getattr(router, name) == getattr(up, name)
    assert router.enforce_disagg and not router.track_active_blocks
    assert {f: getattr(router, f) for f in vars(RouterOptions())} == {f: getattr(up, f) for f in vars(RouterOptions())}


def test_every_command_validates_the_routing_options_alike(capsys):
    from kvmesh.replay import cli
    from kvmesh.router.config import RouterConfig
    from kvmesh.up.config import UpConfig

    for cls in (RouterConfig, UpConfig):
        with pytest.raises(SystemExit):
            parse_config(cls, ["--router-temperature", "-1"], prog="x", description="", environ={})
        assert "--router-temperature must be >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["trace.jsonl", "--router-temperature", "-1"])
    assert "--router-temperature must be >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["trace.jsonl", "--router-mode", "direct"])
    assert "in a replay" in capsys.readouterr().err
    for flags, message in (
        (["--cache-threshold", "1.5"], "--cache-threshold must be between 0 and 1"),
        (["--balance-rel-threshold", "0.5"], "--balance-rel-threshold >= 1"),
        (["--max-tree-size", "0"], "--max-tree-size must be positive"),
        (["--prefill-policy", "direct"], "invalid choice"),
        (["--pooled-block-credit", "1.5"], "--pooled-block-credit must be between 0 and 1"),
    ):
        with pytest.raises(SystemExit):
            parse_config(RouterConfig, flags, prog="x", description="", environ={})
        assert message in capsys.readouterr().err


def test_vllm_engine_arguments_pass_through_without_being_mistaken_for_the_workers(capsys):
    from kvmesh.worker.config import WorkerConfig

    argv = ["--engine", "vllm", "--model", "/m", "--max-model-len", "512", "--block-size", "32"]
    config = parse_config(WorkerConfig, argv, prog="w", description="", environ={})
    assert config.engine_args == ["--model", "/m", "--max-model-len", "512"]
    assert config.model_name == "kvmesh-tiny" and config.block_size == 32  # --model is not --model-name
    with pytest.raises(SystemExit):
        parse_config(WorkerConfig, ["--max-model-len", "512"], prog="w", description="", environ={})
    assert "engine arguments need --engine vllm" in capsys.readouterr().err
    prefill = parse_config(
        WorkerConfig, ["--engine", "vllm", "--role", "prefill"], prog="w", description="", environ={}
    )
    assert prefill.role == "prefill"  # vLLM workers disaggregate through vLLM's NIXL connector


def test_the_mock_keeps_its_shape_defaults_while_vllm_gets_none():
    from kvmesh.worker.config import WorkerConfig
    from kvmesh.worker.engines.vllm.setup import vllm_overrides

    config = parse_config(WorkerConfig, [], prog="w", description="", environ={})
    assert (config.mock_shape("block_size"), config.mock_shape("num_gpu_blocks")) == (16, 16384)
    assert vllm_overrides(config)["block_size"] is None and vllm_overrides(config)["num_gpu_blocks_override"] is None


def test_the_start_up_log_never_shows_an_api_key():
    from kvmesh.common.runtime.config import describe
    from kvmesh.frontend.config import FrontendConfig
    from kvmesh.up.config import UpConfig

    for config_class in (FrontendConfig, UpConfig):
        config = parse_config(config_class, ["--api-key", "s3cret"], prog="x", description="", environ={})
        assert config.api_key == "s3cret"
        assert "s3cret" not in str(describe(config)) and describe(config)["api_key"] == "<set>"


def test_the_advertised_host_is_the_option_else_the_bind_host_and_auto_resolves_this_host():
    assert advertised_host(SimpleNamespace(advertise_host="worker-1", host="0.0.0.0")) == "worker-1"
    assert advertised_host(SimpleNamespace(advertise_host=None, host="127.0.0.1")) == "127.0.0.1"
    auto = advertised_host(SimpleNamespace(advertise_host="auto", host="0.0.0.0"))
    assert auto == socket.gethostbyname(socket.gethostname())


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--planner", "--prefill-workers", "2", "--max-workers", "1"], "--prefill-workers <= --max-workers"),
        (["--planner", "--prefill-workers", "1", "--min-workers", "0"], "1 <= --min-workers"),
        (["--planner", "--engine", "vllm"], "no --engine vllm"),
    ],
)
def test_kvmesh_up_refuses_planner_pools_it_cannot_keep(flags, message, capsys):
    from kvmesh.up.config import UpConfig

    with pytest.raises(SystemExit):
        parse_config(UpConfig, ["--workers", "1", *flags], prog="up", description="", environ={})
    assert message in capsys.readouterr().err


def test_a_disaggregated_compose_planner_needs_two_services(tmp_path, capsys):
    from kvmesh.planner.service import PlannerConfig

    flags = ["--engine-profile", str(tmp_path / "p.json"), "--disaggregated", "--connector", "compose"]
    config = parse_config(PlannerConfig, flags, prog="planner", description="", environ={})
    assert (config.compose_prefill_service, config.compose_service) == ("prefill-worker", "worker")
    with pytest.raises(SystemExit):
        parse_config(
            PlannerConfig, [*flags, "--compose-prefill-service", "worker"], prog="p", description="", environ={}
        )
    assert "must name different services" in capsys.readouterr().err


def test_only_the_kubernetes_connector_marks_departures(tmp_path, capsys):
    from kvmesh.planner.service import PlannerConfig

    def planner(*flags: str) -> PlannerConfig:
        argv = ["--engine-profile", str(tmp_path / "p.json"), *flags]
        return parse_config(PlannerConfig, argv, prog="p", description="", environ={})

    marking = planner("--connector", "kubernetes", "--kubernetes-departure-blocks", "256")
    assert marking.kubernetes_departure_blocks == 256
    for flags, says in (
        (["--connector", "compose", "--kubernetes-departure-blocks", "256"], "is for --connector kubernetes"),
        (["--connector", "kubernetes", "--kubernetes-departure-blocks", "-1"], "0 (off) or positive"),
    ):
        with pytest.raises(SystemExit):
            planner(*flags)
        assert says in capsys.readouterr().err


def test_the_kv_pool_is_the_mock_engines(capsys):
    from kvmesh.up.config import UpConfig
    from kvmesh.worker.config import WorkerConfig

    with pytest.raises(SystemExit):
        parse_config(UpConfig, ["--kv-pool", "auto", "--engine", "vllm"], prog="up", description="", environ={})
    assert "--kv-pool is for mock workers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_config(WorkerConfig, ["--kv-pool-blocks", "4"], prog="w", description="", environ={})
    assert "--kv-pool-blocks must be at least 8" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_config(WorkerConfig, ["--moe-experts", "1-2"], prog="w", description="", environ={})
    assert "--moe-experts: bad MoE placement" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--engine", "served"], "--engine served needs --engine-url"),
        (["--engine", "served", "--engine-url", "127.0.0.1:8100"], "--engine served needs --engine-url"),
        (["--engine", "served", "--engine-url", "http://h:1/v1", "--role", "prefill"], "whole requests only"),
        (["--engine", "served", "--engine-url", "http://h:1/v1", "--engine-kv-replay", "tcp://h:2"], "goes with"),
        (["--engine-url", "http://h:1/v1"], "go with --engine served"),
    ],
)
def test_a_served_engine_needs_its_url_and_fronts_whole_requests(flags, message, capsys):
    from kvmesh.worker.config import WorkerConfig

    with pytest.raises(SystemExit):
        parse_config(WorkerConfig, flags, prog="w", description="", environ={})
    assert message in capsys.readouterr().err


def test_a_served_engine_configuration_and_kvmesh_up_pointing_elsewhere(capsys):
    from kvmesh.up.config import UpConfig
    from kvmesh.worker.config import WorkerConfig

    flags = ["--engine", "served", "--engine-url", "http://127.0.0.1:8100/v1", "--engine-kv-events", "tcp://h:5557"]
    config = parse_config(WorkerConfig, flags, prog="w", description="", environ={})
    assert (config.engine_url, config.engine_kv_events) == ("http://127.0.0.1:8100/v1", "tcp://h:5557")
    with pytest.raises(SystemExit):
        parse_config(UpConfig, ["--engine", "served"], prog="up", description="", environ={})
    assert "kvmesh worker --engine served" in capsys.readouterr().err


def test_the_block_size_and_cache_of_a_vllm_server_come_from_its_metrics():
    from kvmesh.worker.engines.served.served_engine import cache_config

    text = (
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        'vllm:cache_config_info{block_size="32",cache_dtype="auto",num_gpu_blocks="2048"} 1.0\n'
    )
    assert cache_config(text)["block_size"] == "32" and cache_config(text)["num_gpu_blocks"] == "2048"
    assert cache_config("vllm:num_requests_running 0.0\n") == {}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lora-adapters", "sql,sql"], "named twice"),
        (["--lora-adapters", "sql="], "empty path"),
        (["--lora-adapters", "sql", "--max-loras", "-1"], "--max-loras and --lora-load-ms must be >= 0"),
        (["--engine", "vllm", "--lora-adapters", "sql,chat=/nowhere"], "NAME=PATH (sql has none)"),
        (["--engine", "vllm", "--lora-adapters", "chat=/nowhere/at/all"], "no adapter directory at /nowhere/at/all"),
        (["--engine", "served", "--engine-url", "http://h:1/v1", "--lora-adapters", "a=/x"], "loads its adapters"),
    ],
)
def test_lora_adapter_flags_that_cannot_work_are_refused(flags, message, capsys):
    from kvmesh.worker.config import WorkerConfig

    with pytest.raises(SystemExit):
        parse_config(WorkerConfig, flags, prog="w", description="", environ={})
    assert message in capsys.readouterr().err


def test_a_vllm_worker_with_adapters_enables_vllms_lora_with_its_slots(tmp_path):
    from kvmesh.worker.config import WorkerConfig
    from kvmesh.worker.engines.vllm.setup import vllm_overrides

    adapters = f"a={tmp_path},b={tmp_path},c={tmp_path}"
    flags = ["--engine", "vllm", "--lora-adapters", adapters, "--max-loras", "2"]
    config = parse_config(WorkerConfig, flags, prog="w", description="", environ={})
    assert {k: vllm_overrides(config)[k] for k in ("enable_lora", "max_loras", "max_cpu_loras")} == {
        "enable_lora": True,
        "max_loras": 2,
        "max_cpu_loras": 2,
    }
    config = parse_config(WorkerConfig, flags[:4], prog="w", description="", environ={})
    assert vllm_overrides(config)["max_cpu_loras"] == 3  # no --max-loras: all of them


def test_data_parallel_ranks_are_the_mock_engines_and_vllms(capsys):
    from kvmesh.worker.config import WorkerConfig

    flags = ["--engine", "vllm", "--data-parallel-size", "2"]
    config = parse_config(WorkerConfig, flags, prog="w", description="", environ={})
    assert config.data_parallel_size == 2
    served = ["--engine", "served", "--engine-url", "http://h:1/v1", "--data-parallel-size", "2"]
    with pytest.raises(SystemExit):
        parse_config(WorkerConfig, served, prog="w", description="", environ={})
    assert "not --engine served" in capsys.readouterr().err
