"""``kvmesh up`` with SGLang's cache-aware mode and the host KV pool, driven with the openai client;
the MoE routing hint through the HTTP body."""

from __future__ import annotations

import glob
from collections.abc import Iterator

import openai
import pytest

from kvmesh.devtools.mesh_process import MeshProcess
from tests.e2e.conftest import chat, start_mesh

pytestmark = pytest.mark.e2e
BLOCK = 16
LONG_PROMPT = "A pooled KV tier lets another worker resume a request without recomputing it. " * 3


@pytest.fixture(scope="module")
def pooled_round_robin_mesh() -> Iterator[MeshProcess]:
    before = set(glob.glob("/dev/shm/kvmesh-pool-*"))
    yield from start_mesh("--router-mode", "round-robin", "--kv-pool", "auto")
    assert set(glob.glob("/dev/shm/kvmesh-pool-*")) <= before, "the pool directory outlived the mesh"


@pytest.fixture(scope="module")
def cache_aware_mesh() -> Iterator[MeshProcess]:
    yield from start_mesh("--router-mode", "cache-aware")


def test_the_other_worker_imports_the_prompt_from_the_pool(pooled_round_robin_mesh):
    first, first_worker = chat(pooled_round_robin_mesh, LONG_PROMPT, max_tokens=2)
    second, second_worker = chat(pooled_round_robin_mesh, LONG_PROMPT, max_tokens=2)
    assert first_worker != second_worker  # round robin
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # nothing was cached on the second worker: every full block but the last token's came from the pool
    assert second.usage.prompt_tokens_details.cached_tokens == (first.usage.prompt_tokens - 1) // BLOCK * BLOCK


def test_cache_aware_keeps_a_conversation_on_its_worker(cache_aware_mesh):
    _, first = chat(cache_aware_mesh, LONG_PROMPT, max_tokens=2)
    second, second_worker = chat(cache_aware_mesh, LONG_PROMPT + " And a follow-up question?", max_tokens=2)
    assert second_worker == first
    assert second.usage.prompt_tokens_details.cached_tokens >= 8 * BLOCK
    _, other = chat(cache_aware_mesh, "Something else entirely, with no shared prefix at all. " * 3, max_tokens=2)
    assert other != first  # a poor match goes to the worker with the smaller tree


def test_a_moe_query_is_accepted_and_a_bad_one_is_a_400(cache_aware_mesh):
    hint = {"kvmesh": {"router_config_override": {"moe_query": [{"layer": 0, "expert": 3}]}}}
    answer, _ = chat(cache_aware_mesh, "hello", max_tokens=2, extra_body=hint)
    assert answer.choices[0].message.content is not None
    bad = {"kvmesh": {"router_config_override": {"moe_query": [{"layer": 0}]}}}
    with pytest.raises(openai.BadRequestError) as refused:
        chat(cache_aware_mesh, "hello", max_tokens=2, extra_body=bad)
    assert "moe_query" in str(refused.value)
