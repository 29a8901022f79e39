"""``bench.grpc_costs --option`` hands gRPC the channel argument it names, typed as gRPC expects."""

from __future__ import annotations

import pytest

from bench.grpc_costs import channel_option


def test_an_integer_value_is_passed_as_an_integer() -> None:
    assert channel_option("grpc.minimal_stack=1") == ("grpc.minimal_stack", 1)


def test_any_other_value_is_passed_as_text() -> None:
    assert channel_option("grpc.primary_user_agent=kvmesh-bench") == ("grpc.primary_user_agent", "kvmesh-bench")


@pytest.mark.parametrize("text", ["grpc.minimal_stack", "=1", ""])
def test_anything_but_name_equals_value_is_refused_with_the_text(text: str) -> None:
    with pytest.raises(SystemExit, match="--option takes NAME=VALUE"):
        channel_option(text)
