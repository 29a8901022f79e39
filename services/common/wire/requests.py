"""Facts about a preprocessed request that several services rely on."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvmesh.common.proto.kvmesh.v1 import common_pb2

# What a worker generates when a request names no max_tokens (the router accounts with the same).
DEFAULT_MAX_TOKENS = 16
# The HTTP response header naming the worker that served a request: the frontend sets it, and
# `kvmesh bench` reads it without importing the frontend.
WORKER_ID_HEADER = "x-kvmesh-worker-id"


def with_disaggregated_params(request: common_pb2.PreprocessedRequest, params: bytes) -> common_pb2.PreprocessedRequest:
    """A copy of ``request`` carrying ``params`` in its ``disaggregated_params`` (the decode half of a
    split request: where its prompt's KV waits); ``request`` itself is left as it was."""
    split = common_pb2.PreprocessedRequest()
    split.CopyFrom(request)
    split.disaggregated_params = params
    return split


def continue_request(
    request: common_pb2.PreprocessedRequest, generated: Sequence[int], max_tokens: int, suffix: str
) -> common_pb2.PreprocessedRequest:
    """The request that carries on after ``generated`` tokens elsewhere (another worker after a
    migration, another router after a failover): the prompt grows by those tokens, the budget shrinks
    by them, and the id gets ``suffix`` so the new attempt never clashes with the old one."""
    moved = common_pb2.PreprocessedRequest()
    moved.CopyFrom(request)
    moved.request_id = f"{request.request_id}:{suffix}"
    moved.token_ids.extend(generated)
    moved.stop.max_tokens = max_tokens - len(generated)
    # a remote prefill's KV covered the old prompt only; the new attempt prefills where it lands
    moved.ClearField("disaggregated_params")
    return moved


@dataclass
class AnswerUsage:
    """The usage of one answer across all its tries (migrations, failovers), as the client sees it:
    the original prompt, the first try's cached tokens, every token generated so far. The router's
    relay and the frontend's direct path both write it into each output they pass on."""

    prompt_tokens: int
    generated: list[int] = field(default_factory=list)
    cached_tokens: int | None = None  # the first try's (or its remote prefill's), once known
    _cached_from: int | None = None  # the try that said it

    def account(self, output: common_pb2.GenerateOutput, attempt: int = 0) -> common_pb2.GenerateOutput:
        """Count ``output``'s tokens (of try ``attempt``) and write the whole answer's usage into it.
        The cached tokens are those of the first try that answered, as its latest output says: an
        engine behind its own server learns them only with its last output (vLLM's streamed usage)."""
        self.generated.extend(output.token_ids)
        if self._cached_from is None or attempt == self._cached_from:
            self.cached_tokens, self._cached_from = output.usage.cached_prompt_tokens, attempt
        output.usage.prompt_tokens = self.prompt_tokens
        output.usage.completion_tokens = len(self.generated)
        output.usage.cached_prompt_tokens = self.cached_tokens
        return output

    def closing_output(self, worker_id: int) -> common_pb2.GenerateOutput:
        """The closing message for a worker that died right after the last token."""
        return common_pb2.GenerateOutput(
            finish_reason=common_pb2.FINISH_REASON_LENGTH,
            worker_id=worker_id,
            usage=common_pb2.Usage(
                prompt_tokens=self.prompt_tokens,
                completion_tokens=len(self.generated),
                cached_prompt_tokens=self.cached_tokens or 0,
            ),
        )
