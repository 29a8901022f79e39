"""Committed generated files must match their generators."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kvmesh.common.core import tiny_model
from kvmesh.devtools import protogen
from tests.containers.docker_engine import compose_command

REPO = Path(__file__).resolve().parents[2]


def test_generated_protobuf_code_is_up_to_date():
    stale = protogen.stale_files()
    assert stale == [], f"run `kvmesh gen-protos`; stale: {stale}"


def test_stale_code_is_detected(tmp_path):
    copy = tmp_path / "proto"
    shutil.copytree(protogen.OUTPUT_ROOT, copy)
    target = copy / "kvmesh" / "v1" / "common_pb2.py"
    target.write_text(target.read_text() + "\n# edited by hand\n")
    assert protogen.stale_files(copy) == ["kvmesh/v1/common_pb2.py"]


def test_bundled_tiny_model_matches_its_builder(tmp_path):
    tiny_model.write_model(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert json.loads((tmp_path / name).read_text()) == json.loads((tiny_model.MODEL_DIR / name).read_text())


COMPOSE = compose_command()
COMPOSE_FILES = ["docker-compose.yml", "docker-compose.host.yml"]


@pytest.mark.skipif(COMPOSE is None, reason="neither `docker compose` nor `docker-compose` is installed")
@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_docker_compose_file_is_valid(name):
    result = subprocess.run(
        [*COMPOSE, "-f", str(REPO / name), "config", "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


def _role(command: list[str]) -> str:
    return command[command.index("--role") + 1] if "--role" in command else "aggregated"


def _kvmesh_services(services: dict) -> dict:
    """The mesh's own services (not the observability profile's Prometheus and Grafana)."""
    return {name: s for name, s in services.items() if "observability" not in s.get("profiles", [])}


def test_the_host_network_compose_file_runs_the_same_services():
    bridge = _kvmesh_services(yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"])
    host = yaml.safe_load((REPO / "docker-compose.host.yml").read_text())["services"]
    assert sorted(host) == sorted(bridge)
    for name, service in host.items():
        assert service["network_mode"] == "host", name
        assert "ports" not in service, f"{name}: a host-network container cannot publish ports"
        assert service.get("profiles") == bridge[name].get("profiles"), name
        if name == "nats":
            continue
        # the same kvmesh service in the same role; only addresses differ
        assert service["command"][0] == bridge[name]["command"][0], name
        assert _role(service["command"]) == _role(bridge[name]["command"]), name
        assert service["init"] is True and bridge[name]["init"] is True, f"{name}: PID 1 must forward SIGTERM"


@pytest.mark.skipif(COMPOSE is None, reason="neither `docker compose` nor `docker-compose` is installed")
def test_docker_compose_check_rejects_a_broken_file(tmp_path):
    broken = tmp_path / "docker-compose.yml"
    broken.write_text("services:\n  frontend:\n    ports: 8000\n")
    result = subprocess.run([*COMPOSE, "-f", str(broken), "config", "--quiet"], capture_output=True, timeout=60)
    assert result.returncode != 0


def test_prometheus_scrapes_every_kvmesh_service_of_the_compose_file():
    services = _kvmesh_services(yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"])
    config = yaml.safe_load((REPO / "observability" / "prometheus.yml").read_text())
    targets = {
        target.split(":")[0]
        for job in config["scrape_configs"]
        for static in job.get("static_configs", [])
        for target in static["targets"]
    }
    # a scaled service has no fixed names: its replicas are found through Docker's DNS
    jobs = config["scrape_configs"]
    targets |= {name for job in jobs for sd in job.get("dns_sd_configs", []) for name in sd["names"]}
    assert targets == set(services) - {"nats"}
