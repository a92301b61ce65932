"""The keyword parameters of ``Client.submit`` / ``AsyncClient.submit``, declared once
(``SubmitOptions``, which both take as ``**options``; type checkers and editors see each
name and type): one per JobRequest field (wire/schema.py, its sampling fields declared in
wire/sampling.py) but ``v`` (the schema version), ``id`` (``job_id``) and ``prompt`` (the
positional argument), and OpenAI's names for some of them. tests/test_pagedq_package.py
fails when JobRequest gains a field that SubmitOptions lacks; tests/test_typing.py runs
mypy over a caller.
"""
from __future__ import annotations

from typing import Any, TypedDict

from pagedq.wire.guided import GuidedSpec
from pagedq.wire.schema import ChatMessage, JobRequest

from . import requests

NAMED_ON_THEIR_OWN = frozenset({"v", "id", "prompt", "messages", "model"})
SUBMIT_FIELDS = frozenset(JobRequest.model_fields) - NAMED_ON_THEIR_OWN


class SubmitOptions(TypedDict, total=False):
    """submit()'s keywords; what each means and its default: Client.submit's docstring."""

    messages: list[dict[str, Any] | ChatMessage] | None
    model: str | None
    tools: list[dict[str, Any]] | None
    tool_choice: str | dict[str, Any] | None
    parallel_tool_calls: bool | None
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    min_p: float | None
    repetition_penalty: float | None
    presence_penalty: float | None
    frequency_penalty: float | None
    stop: list[str] | str | None
    stop_token_ids: list[int] | None
    seed: int | None
    ignore_eos: bool | None
    min_tokens: int | None
    logprobs: int | None
    prompt_logprobs: int | None
    n: int | None
    guided: dict[str, Any] | GuidedSpec | None
    logit_bias: dict[int | str, float] | None
    priority: int | None
    lane: str | None
    timeout_s: float | None
    metadata: dict[str, str] | None
    job_id: str | None
    require_worker: bool
    # OpenAI's names (requests.py maps them; any other name is refused by validation)
    max_completion_tokens: int | None
    top_logprobs: int | None
    user: str | None
    response_format: dict[str, Any] | None


def build(prompt: str | list[int] | None, options: dict[str, Any], default_model: str,
          partitions: int) -> tuple[JobRequest, bool]:
    """A submit() call's request, validated (InvalidRequest), and its require_worker. None =
    unset (the schema's default); a name neither a field nor OpenAI's is refused."""
    options = dict(options)
    messages, model = options.pop("messages", None), options.pop("model", None)
    job_id, require_worker = options.pop("job_id", None), options.pop("require_worker", False)
    explicit = {k: options.pop(k) for k in list(options) if k in SUBMIT_FIELDS}
    req = requests.build_request(prompt, messages, model or default_model, job_id, explicit,
                                 options, partitions)
    return req, bool(require_worker)
