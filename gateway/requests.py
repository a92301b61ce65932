"""An HTTP request body of /v1/completions or /v1/chat/completions -> the JobRequests it
submits (one per prompt of a completions list), and what the response needs (stream or
not, usage, logprobs, echo, detach, resume).

The body is OpenAI's (``response_format``, ``tools``, ``tool_choice``,
``parallel_tool_calls``, ``logit_bias`` included; the fields that change nothing ignored,
those not served refused: wire/openai_fields.py); what JobRequest takes beyond it
(``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``priority``, ``lane``, ``timeout_s``) is accepted too, as vLLM
accepts its extras. The endpoint shape is wire/openai_api.py's (shared with batch files);
``stream_options`` takes ``include_usage``, vLLM's ``continuous_usage_stats`` and
``include_obfuscation`` (ignored). Fields of the gateway itself go in the extension
object ``pagedq``:

* ``detach`` (bool): the job goes on when the client disconnects (default: cancelled);
  also the header ``X-Pagedq-Detach: 1``;
* ``job_id`` (string, ``[A-Za-z0-9_.:-]{1,128}``): the job's id (default: a new uuid4
  hex). Sending the same body with the same id again is idempotent (the job is not made
  twice; the response follows it), a different body with it is refused (409).

Deterministic: the same body gives the same JobRequest (same bytes), which is what makes
a re-sent request with a ``job_id`` idempotent.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from pagedq.wire.keys import JOB_ID_RE, new_job_id
from pagedq.wire.openai_api import FieldError, shape
from pagedq.wire.schema import JobRequest, describe
from pagedq.wire.scripts import queued_tokens_of

from .errors import APIError, bad_request

GATEWAY_FIELDS = ("id", "v")  # set by the gateway, refused in a body
STREAM_OPTIONS = frozenset({"include_usage", "continuous_usage_stats", "include_obfuscation"})
EXTENSION = "pagedq"
TRUE = ("1", "true", "yes", "on")


@dataclass(frozen=True, slots=True)
class Generation:
    kind: str  # "chat" or "completion"
    reqs: tuple[JobRequest, ...]  # with their ids and model: one job per prompt
    stream: bool
    include_usage: bool
    detach: bool
    resume: tuple[str, int, int] | None  # Last-Event-ID: (job id, event, chunk)
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage each chunk
    echo: bool = False  # completions: each choice repeats its prompt (wire/openai_api.py)
    texts: tuple[str | None, ...] = ()  # each job's prompt text (None: token ids)

    @property
    def req(self) -> JobRequest:
        return self.reqs[0]

    @property
    def job_id(self) -> str:
        """The first job's (the response's id names it)."""
        return self.req.id  # type: ignore[return-value]

    @property
    def job_ids(self) -> list[str]:
        return [r.id for r in self.reqs]  # type: ignore[misc]

    @property
    def logprobs(self) -> bool:
        return self.req.logprobs is not None

    @property
    def tools(self) -> bool:
        """The job's tools are active: its output may be calls (wire/tools.py)."""
        return self.req.tools_active

    def est_tokens(self) -> int:
        """What the request may cost: prompt characters / 4 + max_tokens for each choice."""
        return sum(queued_tokens_of(r) + (r.n - 1) * r.max_tokens for r in self.reqs)


MAX_JSON_DEPTH = 100  # objects and arrays nested deeper are refused (400), not parsed on


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"the body is not JSON: {e}", code="invalid_json") from None
    except RecursionError:  # deeper than the parser goes (the interpreter's recursion limit)
        body = None
    if body is None or _too_deep(body, MAX_JSON_DEPTH):
        raise bad_request(f"the body's JSON is nested more than {MAX_JSON_DEPTH} levels deep",
                          code="invalid_json")
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object", code="invalid_json")
    return body


def _too_deep(obj: Any, limit: int) -> bool:
    """Are arrays or objects nested more than ``limit`` levels deep? (no recursion)"""
    stack = [(obj, 1)]
    while stack:
        o, depth = stack.pop()
        if isinstance(o, dict | list):
            if depth > limit:
                return True
            stack.extend((v, depth + 1) for v in (o.values() if isinstance(o, dict) else o))
    return False


def check_vocabulary(req: JobRequest, vocab_size: int | None) -> None:
    """Token ids of the prompt and of ``logit_bias`` must be below the vocabulary size the
    model's workers announced (``{P}:vocab``; None: not known yet, the worker checks)."""
    if not vocab_size:
        return
    if isinstance(req.prompt, list) and (bad := [t for t in req.prompt if t >= vocab_size]):
        raise bad_request(f"prompt token id {bad[0]} is outside the model's vocabulary "
                          f"[0, {vocab_size})", "prompt", "invalid_token_id")
    if req.logit_bias and (bad := [t for t in req.logit_bias if t >= vocab_size]):
        raise bad_request(f"logit_bias token id {bad[0]} is outside the model's vocabulary "
                          f"[0, {vocab_size})", "logit_bias", "invalid_token_id")


def parse_event_id(value: str) -> tuple[str, int, int]:
    """``<job id>/<event>.<chunk>`` (gateway/stream.py) -> its parts; 400 if malformed."""
    job, _, pos = value.strip().rpartition("/")
    k, _, j = pos.partition(".")
    if not (JOB_ID_RE.match(job) and k.isdigit() and j.isdigit()):
        raise bad_request(f"Last-Event-ID {value!r} is not an event id of this gateway "
                          "(<job id>/<event>.<chunk>)", "Last-Event-ID", "invalid_event_id")
    return job, int(k), int(j)


def generation(kind: str, body: dict[str, Any], default_model: str,
               headers: dict[str, str], partitions: int = 1) -> Generation:
    """The request of a body (``headers``: lower-case names); APIError 400 if invalid. A
    new job id names one of ``partitions`` (wire/keys.py new_job_id); a completions body
    of several prompts makes a job each (``<job_id>-<i>`` with a given job_id)."""
    data = {k: v for k, v in body.items() if v is not None}  # OpenAI clients send nulls
    model = data.pop("model", default_model)
    stream = data.pop("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("stream must be true or false", "stream")
    usage, continuous = stream_options(data.pop("stream_options", {}), stream)
    detach, job_id = extension(data, headers)
    for i, m in enumerate((data.get("messages") or []) if kind == "chat" else []):
        if isinstance(m, dict) and m.get("role") == "tool" and not m.get("tool_call_id"):
            raise bad_request(f"messages[{i}]: a tool message needs the tool_call_id of the "
                              "call it answers", f"messages[{i}].tool_call_id")
    try:
        sh = shape(kind, data)
    except FieldError as e:
        raise bad_request(str(e), e.param) from None
    resume = None
    if last := headers.get("last-event-id"):
        resume = parse_event_id(last)
        if job_id is not None and job_id != resume[0]:
            raise bad_request("Last-Event-ID names another job than pagedq.job_id",
                              "Last-Event-ID")
        if len(sh.prompts) > 1:
            raise bad_request("a stream of several prompts cannot be resumed: send them one "
                              "per request to resume", "Last-Event-ID")
        job_id = resume[0]
        if not stream:
            raise bad_request("Last-Event-ID resumes a stream: send stream: true",
                              "Last-Event-ID")
    many = len(sh.prompts) > 1
    reqs = tuple(job_request(
        data if p is None else {**data, "prompt": p},
        (f"{job_id}-{i}" if many else job_id) if job_id else new_job_id(partitions), model)
        for i, p in enumerate(sh.prompts))
    return Generation(kind, reqs, stream, usage, detach, resume, continuous, sh.echo,
                      tuple(p if isinstance(p, str) else None for p in sh.prompts))


def stream_options(opts: Any, stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous usage: every chunk's, vLLM's extension, with
    include_usage) of ``stream_options``; ``include_obfuscation`` is accepted and
    ignored (nothing is padded)."""
    if not isinstance(opts, dict) or set(opts) - STREAM_OPTIONS:
        raise bad_request(f"stream_options takes {', '.join(sorted(STREAM_OPTIONS))}",
                          "stream_options")
    if opts and not stream:
        raise bad_request("stream_options needs stream: true", "stream_options")
    for name, v in opts.items():
        if not isinstance(v, bool):
            raise bad_request(f"stream_options.{name} must be true or false",
                              f"stream_options.{name}")
    usage = opts.get("include_usage", False)
    return usage, usage and opts.get("continuous_usage_stats", False)


def extension(data: dict[str, Any], headers: dict[str, str]) -> tuple[bool, str | None]:
    """(detach, job_id) of the ``pagedq`` extension object (taken out of ``data``) and
    the headers; the gateway's own fields refused in a body."""
    ext = data.pop(EXTENSION, {})
    if not isinstance(ext, dict) or set(ext) - {"detach", "job_id"}:
        raise bad_request("pagedq takes detach and job_id", EXTENSION)
    detach = ext.get("detach", False)
    if not isinstance(detach, bool):
        raise bad_request("pagedq.detach must be true or false", "pagedq.detach")
    detach = detach or headers.get("x-pagedq-detach", "").strip().lower() in TRUE
    for name in GATEWAY_FIELDS:
        if name in data:
            raise bad_request(f"{name} is set by the gateway (a job id: pagedq.job_id)", name)
    job_id = ext.get("job_id")
    if job_id is not None and not (isinstance(job_id, str) and JOB_ID_RE.match(job_id)):
        raise bad_request("pagedq.job_id must be 1-128 of [A-Za-z0-9_.:-]", "pagedq.job_id")
    return detach, job_id


def job_request(data: dict[str, Any], job_id: str, model: str) -> JobRequest:
    """``data`` (JobRequest fields, OpenAI's names) as the job ``job_id`` of ``model``;
    400 naming the field if invalid, or if its output's grammar does not compile."""
    guided_by = "response_format" if "response_format" in data else "guided"
    try:
        req = JobRequest.model_validate({**data, "id": job_id, "model": model})
    except ValidationError as e:
        msg = describe(e)
        head = msg.split(":", 1)[0]
        raise APIError(400, msg, "invalid_request",
                       head if head and " " not in head else None) from None
    try:  # before anything is queued (the client checks again: remembered, no cost)
        req.check_output()
    except ValueError as e:
        raise APIError(400, f"{e} (the output's grammar does not compile)", "invalid_request",
                       "tools" if str(e).startswith("tools") else guided_by) from None
    return req
