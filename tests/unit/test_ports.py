"""Ports handed to servers come from below the kernel's ephemeral range, where nothing takes them unasked."""

from __future__ import annotations

import random
import socket

import pytest

from kvmesh.common.runtime import ports


def test_a_free_port_is_free_and_below_the_ephemeral_range():
    port = ports.free_port()
    assert ports.LOWEST_CANDIDATE <= port < ports.ephemeral_low()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))  # raises if it were taken


def test_a_taken_port_is_passed_over():
    first_choice = ports.free_port(rng=random.Random(7))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", first_choice))
        holder.listen()
        chosen = ports.free_port(rng=random.Random(7))
    assert chosen != first_choice


def test_the_ephemeral_range_is_read_from_the_kernel_setting(tmp_path, monkeypatch):
    setting = tmp_path / "ip_local_port_range"
    setting.write_text("20000\t60999\n")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", setting)
    assert ports.ephemeral_low() == 20000
    assert all(ports.free_port() < 20000 for _ in range(20))


def test_an_unreadable_setting_falls_back_to_linux_default(tmp_path, monkeypatch):
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", tmp_path / "missing")
    assert ports.ephemeral_low() == ports.DEFAULT_EPHEMERAL_LOW


def test_no_room_below_the_ephemeral_range_is_a_clear_error(tmp_path, monkeypatch):
    setting = tmp_path / "ip_local_port_range"
    setting.write_text("1024 60999\n")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", setting)
    with pytest.raises(ports.NoFreePortError, match="ephemeral port range starts at 1024"):
        ports.free_port()


def test_a_clusters_ports_are_all_distinct_though_draws_repeat(monkeypatch):
    """Each port is found free before any server binds it, so two draws can return the same one; a
    cluster's route and client ports are drawn until distinct (CI once saw a route port taken)."""
    from kvmesh.common.runtime import nats_cluster

    draws = iter([20000, 20000, 20001, 20000, 20002, 20001, 20003, 20004, 20004, 20005])
    monkeypatch.setattr(nats_cluster, "free_port", lambda host: next(draws))
    cluster = nats_cluster.EmbeddedNatsCluster(size=3)
    try:
        used = [node.port for node in cluster.nodes]
        for node in cluster.nodes:
            used += [int(a.rsplit(":", 1)[1]) for a in node.server_args if a.startswith("nats://")][:1]
        assert sorted(used) == [20000, 20001, 20002, 20003, 20004, 20005]
    finally:
        cluster.stop()
