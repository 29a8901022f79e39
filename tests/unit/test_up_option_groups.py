"""``kvmesh up`` declares no service option of its own: it takes each service's option group and hands
it on, so a service started by ``kvmesh up`` parses exactly the values ``kvmesh up`` was given."""

from __future__ import annotations

import dataclasses

from kvmesh.common.runtime.config import GrpcEndpointConfig
from kvmesh.frontend.config import FrontendConfig, HttpApiOptions
from kvmesh.indexer.config import IndexerConfig, SnapshotOptions
from kvmesh.planner.options import PlannerOptions
from kvmesh.router.config import RouterConfig, RouterOptions
from kvmesh.up.config import UpConfig
from kvmesh.up.processes import plan_services
from kvmesh.worker.config import EngineOptions, WorkerConfig
from tests.support import service_config

ARGV = [
    "--workers",
    "1",
    "--http-port",
    "18123",
    "--max-concurrent-requests",
    "7",
    "--api-key",
    "sekrit",
    "--speedup-ratio",
    "3.5",
    "--block-size",
    "32",
    "--kv-transfer-backend",
    "tcp",
    "--router-snapshot-threshold",
    "1234",
    "--migration-limit",
    "5",
]
GROUPS = {"frontend": (FrontendConfig, HttpApiOptions), "router": (RouterConfig, RouterOptions)}
GROUPS |= {"indexer": (IndexerConfig, SnapshotOptions), "worker": (WorkerConfig, EngineOptions)}


def test_each_service_parses_the_values_kvmesh_up_was_given():
    up = service_config(UpConfig, ARGV)
    by_kind = {process.name.split("-")[0]: process for process in plan_services(up, "nats://127.0.0.1:4222")}
    assert set(by_kind) == set(GROUPS)
    for kind, (config_class, group) in GROUPS.items():
        process = by_kind[kind]
        argv = process.argv[process.argv.index("-m") + 2 :]
        parsed = service_config(config_class, argv)
        for field in dataclasses.fields(group):
            if field.metadata.get("secret"):
                continue  # through the environment, never the command line
            assert getattr(parsed, field.name) == getattr(up, field.name), f"{kind}: {field.name}"
    frontend = by_kind["frontend"]
    assert "sekrit" not in " ".join(frontend.argv) and frontend.env["KVMESH_API_KEY"] == "sekrit"


def test_kvmesh_up_redeclares_no_option_of_a_service():
    groups = (HttpApiOptions, SnapshotOptions, EngineOptions, RouterOptions, PlannerOptions)
    for group in groups:  # each group's fields are UpConfig's through the group, as the group declares them
        for f in dataclasses.fields(group):
            assert UpConfig.__dataclass_fields__[f.name].metadata is f.metadata
    shared = {f.name for f in dataclasses.fields(GrpcEndpointConfig)}
    grouped = {f.name for group in groups for f in dataclasses.fields(group)}
    own = set(UpConfig.__dataclass_fields__) - grouped - shared
    services = {f.name for c in (FrontendConfig, WorkerConfig, IndexerConfig) for f in dataclasses.fields(c)} - shared
    # declared by kvmesh up itself: the KV pool (a directory, as a worker's; kvmesh up also takes auto and
    # hands its workers the directory it chose), and vLLM's arguments for every worker
    assert own & services == {"kv_pool", "engine_args"}
    for name in own & services:
        assert UpConfig.__dataclass_fields__[name].type == WorkerConfig.__dataclass_fields__[name].type


def test_kvmesh_up_help_groups_what_belongs_together():
    """Each mode's and each engine feature's options under a heading of their own, in that order."""
    from kvmesh.common.runtime.config import build_parser

    text = build_parser(UpConfig, "kvmesh up", "").format_help()
    headings = [line for line in text.splitlines() if line and not line.startswith(" ") and line.endswith(":")]
    routing = [h.split(":")[0] for h in headings if h.startswith("Routing")]
    engine = [h.split(":")[0] for h in headings if h.startswith("Engine")]
    assert routing == [
        "Routing",
        "Routing, kv mode",
        "Routing, cache-aware mode (SGLang's policy)",
        "Routing, prefill/decode split",
        "Routing, admission",
        "Routing, sessions",
    ]
    assert engine == [
        "Engine",
        "Engine, mock",
        "Engine, LoRA adapters",
        "Engine, data parallelism",
        "Engine, KV handoff",
        "Engine, cache moves",
    ]

    def section_of(flag: str) -> str:
        before = text[: text.index(f"  {flag} ")]
        return [h for h in headings if h in before][-1]

    assert section_of("--cache-threshold").startswith("Routing, cache-aware mode")
    assert section_of("--disagg-split-when").startswith("Routing, prefill/decode split")
    assert section_of("--router-queue-size").startswith("Routing, admission")
    assert section_of("--speedup-ratio").startswith("Engine, mock")
    assert section_of("--max-loras").startswith("Engine, LoRA")
    assert section_of("--shrink-handoff-blocks").startswith("Engine, cache moves")


def test_the_kv_pool_is_a_directory_in_kvmesh_up_as_in_a_worker(tmp_path):
    """A directory given to kvmesh up goes to every worker as it is; ``auto`` is one of kvmesh up's own."""
    given = service_config(UpConfig, ["--kv-pool", str(tmp_path)])
    auto = service_config(UpConfig, ["--kv-pool", "auto"])
    for config, expected in ((given, str(tmp_path)), (auto, None)):
        workers = [p for p in plan_services(config, "nats://127.0.0.1:4222") if p.name.startswith("worker")]
        pools = {p.argv[p.argv.index("--kv-pool") + 1] for p in workers}
        assert len(pools) == 1
        (pool,) = pools
        assert pool == expected if expected else pool.rsplit("/", 1)[-1].startswith("kvmesh-pool-")
