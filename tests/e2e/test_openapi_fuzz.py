"""Schemathesis fuzzes the HTTP API from its own OpenAPI document (request bodies included) against
`kvmesh up`: for every operation, requests that fit the schema and requests that break it; every
answer is below 500, errors come in OpenAI's shape, and the mesh serves afterwards. The model's
context is cut to 512 tokens so every accepted request is short; examples are deterministic so CI
cannot find a new case by chance: 40 per operation and mode in the default suite, 200 in the slow
tier. (Schemathesis's own pytest plugin does not run under pytest 9, so
its per-operation Hypothesis strategies drive a plain test.)"""

from __future__ import annotations

from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from kvmesh.devtools.mesh_process import MeshProcess
from tests.support import small_context_model

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("examples", [40, pytest.param(200, marks=pytest.mark.slow)])
def test_every_request_the_schema_generates_gets_an_answer_below_500(tmp_path, examples: int):
    model = small_context_model(tmp_path, 512)
    mesh = MeshProcess(
        "--workers", "1", "--speedup-ratio", "200", "--model-path", str(model), "--log-level", "warning"
    ).start()
    outcomes: Counter[tuple[str, int]] = Counter()
    try:
        schema = schemathesis.openapi.from_url(f"{mesh.base_url}/openapi.json")
        operations = [result.ok() for result in schema.get_all_operations()]
        assert {op.label for op in operations} >= {"POST /v1/completions", "POST /v1/chat/completions"}
        for operation in operations:
            # a request that breaks the schema needs something to break: a body (GETs here take none)
            has_body = operation.method.upper() == "POST"
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if has_body else (GenerationMode.POSITIVE,):

                @settings(
                    max_examples=examples,
                    deadline=None,
                    database=None,
                    derandomize=True,
                    suppress_health_check=list(HealthCheck),
                )
                @given(operation.as_strategy(mode))
                def answers_below_500(case) -> None:
                    response = case.call(timeout=30)
                    outcomes[(case.operation.label, response.status_code)] += 1
                    assert response.status_code < 500, f"{case.operation.label}: {response.text[:300]}"
                    if response.status_code >= 400:
                        error = response.json()["error"]
                        assert error["message"] and error["type"]

                answers_below_500()
        body = {"model": "kvmesh-tiny", "prompt": "still serving?", "max_tokens": 3}
        after = httpx.post(f"{mesh.api}/completions", json=body, timeout=30)
        assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 3
    finally:
        assert mesh.stop() == 0
    print(f"\nschemathesis: {sum(outcomes.values())} requests: {dict(sorted(outcomes.items()))}")
    completions = {s for (label, s), n in outcomes.items() if label.endswith("/completions")}
    assert 200 in completions and any(400 <= s < 500 for s in completions)
