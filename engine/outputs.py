"""What the engine reports back, per step and per finished request."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class FinishReason(StrEnum):
    """Why the engine ended a request (vLLM's FinishReason): a stop token, stop string or
    EOS; max_tokens or the model's context; aborted by its caller."""

    stop = "stop"
    length = "length"
    abort = "abort"


@dataclass(slots=True)
class StepOutput:
    """New tokens of one request in one step. ``delta`` is text safe to publish: the
    concatenation of a request's deltas is always its final text (stop strings never leak).
    """

    request_id: str
    new_token_ids: list[int]
    delta: str
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    logprobs: list[Any] | None = None
    # params.prompt_logprobs: the prompt's entries (TokenLogprobs of tokens 1..; the first
    # token has none), on the request's first output only
    prompt_logprobs: list[Any] | None = None


@dataclass(slots=True)
class RequestOutput:
    """A finished request of the offline ``generate()`` API."""

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    logprobs: list[Any] | None = None
    samples: list[RequestOutput] = field(default_factory=list)  # all n samples when n > 1
    prompt_logprobs: list[Any] | None = None  # see StepOutput
