"""Committed generated files must match their generators."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from kvmesh.common import protogen, tiny_model

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


def _compose_command() -> list[str] | None:
    """`docker compose` (v2 plugin) where installed, else the standalone `docker-compose`."""
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


COMPOSE = _compose_command()


@pytest.mark.skipif(COMPOSE is None, reason="neither `docker compose` nor `docker-compose` is installed")
def test_docker_compose_file_is_valid():
    result = subprocess.run(
        [*COMPOSE, "-f", str(REPO / "docker-compose.yml"), "config", "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(COMPOSE is None, reason="neither `docker compose` nor `docker-compose` is installed")
def test_docker_compose_check_rejects_a_broken_file(tmp_path):
    broken = tmp_path / "docker-compose.yml"
    broken.write_text("services:\n  frontend:\n    ports: 8000\n")
    result = subprocess.run([*COMPOSE, "-f", str(broken), "config", "--quiet"], capture_output=True, timeout=60)
    assert result.returncode != 0
