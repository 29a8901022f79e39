"""TLS on the gRPC request path: `kvmesh up --grpc-tls-cert/--grpc-tls-key/--grpc-tls-ca` serves
every gRPC server over TLS only; the mesh answers end to end (frontend → router → worker, router →
indexer), a plain-text client is refused, and a client trusting the CA (generated stubs, the
inspect tool) is served."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc
import openai
import pytest

from kvmesh.common.proto.kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2_grpc
from kvmesh.common.wire.request_reports import END, RequestReport, encode_reports
from kvmesh.devtools.mesh_process import MeshProcess
from tests.certificates import make_certificates
from tests.support import discovered

pytestmark = pytest.mark.integration


def test_the_request_path_over_tls(tmp_path: Path):
    files = make_certificates(tmp_path)
    mesh = MeshProcess(
        "--workers",
        "1",
        "--grpc-tls-cert",
        str(files["server_cert"]),
        "--grpc-tls-key",
        str(files["server_key"]),
        "--grpc-tls-ca",
        str(files["ca"]),
    ).start()
    try:
        answer = openai.OpenAI(base_url=mesh.api, api_key="unused", max_retries=0).completions.create(
            model="kvmesh-tiny", prompt="over TLS all the way", max_tokens=4
        )
        assert answer.usage.completion_tokens == 4

        (router,) = discovered(mesh.nats_url, "router")
        request = common_pb2.PreprocessedRequest(request_id="tls", token_ids=list(range(40)))
        request.stop.max_tokens = 3
        query = router_pb2.RouteRequest()
        query.request.CopyFrom(request)
        with grpc.insecure_channel(router.address) as plain:
            with pytest.raises(grpc.RpcError) as refused:
                router_pb2_grpc.RouterStub(plain).Route(query, timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        trusted = grpc.ssl_channel_credentials(root_certificates=files["ca"].read_bytes())
        with grpc.secure_channel(router.address, trusted) as secure:
            stub = router_pb2_grpc.RouterStub(secure)
            route = stub.Route(query, timeout=10)
            with grpc.secure_channel(route.worker_address, trusted) as to_worker:
                outputs = worker_pb2_grpc.WorkerStub(to_worker).Generate(request, timeout=10)
                assert sum(len(o.token_ids) for o in outputs) == 3
            ended = encode_reports([RequestReport(END, "tls", "completed", 3)])
            list(stub.RouteMany(iter([router_pb2.RouteQueries(reports=ended)]), timeout=10))
            assert stub.GetStatus(router_pb2.RouterStatusRequest(), timeout=10).mode

        inspect = [sys.executable, "-m", "kvmesh", "inspect", "router", "--nats-url", mesh.nats_url, "--json"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_GRPC_TLS")}
        with_ca = subprocess.run(
            inspect, capture_output=True, text=True, timeout=60, env={**env, "KVMESH_GRPC_TLS_CA": str(files["ca"])}
        )
        assert with_ca.returncode == 0 and '"mode"' in with_ca.stdout, with_ca.stderr
    finally:
        assert mesh.stop() == 0


def test_a_certificate_without_its_key_is_a_clear_error(tmp_path: Path):
    files = make_certificates(tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "kvmesh.router", "--grpc-tls-cert", str(files["server_cert"])],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0 and "--grpc-tls-cert and --grpc-tls-key go together" in result.stderr
