"""The wire schema (version 1): job requests, job records and events.

pydantic validates at the boundary (submit, worker intake, client reads). The worker's
hot path builds event field dicts with the plain functions at the bottom, never models.
Requests are validated strictly (no "4" for 4): producers in any language send JSON, and
a type they got wrong is an error they should see, not a guess.
"""
from __future__ import annotations

import json
import math
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .guided import GuidedSpec
from .openai_fields import response_format
from .sampling import (  # noqa: F401 - describe, MAX_N, MAX_TOKENS_LIMIT: the schema's names too
    MAX_N,
    MAX_STOP_STRINGS,
    MAX_TOKENS_LIMIT,
    SamplingParams,
    Text,
    describe,
    with_sampling,
)
from .tools import MAX_TOOLS, Tool, ToolCall, ToolChoice, check_output, mode, output_spec, problem

SCHEMA_VERSION = 1
MAX_PROMPT_CHARS = 1_000_000
LOGPROB_FLOOR = -9999.0  # what -inf (and NaN) log-probabilities are written as: JSON has no inf


class Status(StrEnum):
    queued = "queued"
    running = "running"
    finished = "finished"
    failed = "failed"
    cancelled = "cancelled"
    expired = "expired"


TERMINAL = frozenset({Status.finished, Status.failed, Status.cancelled, Status.expired})


class FinishReason(StrEnum):
    """Why a job (or one of its choices) ended. ``deadline`` ends a running job (status
    finished, partial text) or a queued one (status expired); ``no_worker`` expires a job
    of a model no worker served (worker/recovery.py)."""

    stop = "stop"  # a stop string, a stop token or EOS
    length = "length"  # max_tokens, or the model's context
    cancelled = "cancelled"
    deadline = "deadline"  # the job's timeout_s ran out
    error = "error"  # status failed; the record's error says why
    no_worker = "no_worker"


class ChatMessage(BaseModel):
    """One chat message. ``content`` may also be OpenAI's list of parts; text parts are
    joined with newlines (as vLLM does), other part types are refused. An assistant
    message may carry the ``tool_calls`` it made (then its content may be null), a tool
    message the ``tool_call_id`` it answers (wire/tools.py)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "user", "assistant", "tool"]
    content: Text | None = None
    name: Annotated[str, Field(max_length=256)] | None = None
    tool_calls: Annotated[list[ToolCall], Field(min_length=1, max_length=MAX_TOOLS)] | None = None
    tool_call_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _openai_shapes(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if data.get("role") == "developer":  # OpenAI's newer name for the system role
            data["role"] = "system"
        content = data.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str) and set(part) <= {"type", "text"}):
                    raise ValueError("content parts must be {\"type\": \"text\", \"text\": str}; "
                                     "only text is supported")
                texts.append(part["text"])
            data["content"] = "\n".join(texts)
        if data.get("tool_calls") == []:  # some clients send an empty list for none
            del data["tool_calls"]
        return data

    @model_validator(mode="after")
    def _parts(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("only a tool message has a tool_call_id")
        if self.content is None and self.tool_calls is None:
            raise ValueError("content is required (null only in an assistant message with "
                             "tool_calls)")
        return self

    @property
    def text(self) -> str:
        return self.content or ""


def _openai_aliases(data: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's request names -> ours: ``max_completion_tokens`` -> ``max_tokens``;
    chat's ``logprobs: true`` + ``top_logprobs: k`` -> ``logprobs: k`` (``false`` -> none);
    ``user`` -> ``metadata.user``; ``stop: null`` -> no stop strings; ``response_format``
    (json_object, json_schema) -> ``guided`` (text: none); ``tools: []`` -> no tools."""
    data = dict(data)
    if "max_completion_tokens" in data:
        mct = data.pop("max_completion_tokens")
        if "max_tokens" in data and data["max_tokens"] != mct:
            raise ValueError("max_tokens and max_completion_tokens differ; send one of them")
        data["max_tokens"] = mct
    top = data.pop("top_logprobs", None)
    lp = data.get("logprobs")
    if isinstance(lp, bool):
        data["logprobs"] = (top if top is not None else 0) if lp else None
        if top is not None and not lp:
            raise ValueError("top_logprobs needs logprobs: true")
    elif top is not None:
        raise ValueError("top_logprobs needs logprobs: true (chat form) or use logprobs: <int>")
    if "user" in data:
        user = data.pop("user")
        meta = dict(data.get("metadata") or {})
        meta.setdefault("user", user)
        data["metadata"] = meta
    if data.get("stop", []) is None:
        del data["stop"]
    if "response_format" in data:
        guided = response_format(data.pop("response_format"))
        if guided is not None:
            if "guided" in data:
                raise ValueError("response_format and guided are both given; send one")
            data["guided"] = guided
    if data.get("tools", None) == []:
        del data["tools"]
    return data


class _RequestHead(BaseModel):
    """What a job is: its schema version, id, model and input (JobRequest's first fields;
    then the sampling fields of wire/sampling.py, then its own)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    v: Literal[1] = SCHEMA_VERSION
    id: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:\-]{1,128}$")] | None = None
    model: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,128}$")] = "smollm2"
    # text, or token ids (as OpenAI's completions API allows) for clients that tokenize
    prompt: Text | list[Annotated[int, Field(ge=0, lt=2**31)]] | None = None
    messages: list[ChatMessage] | None = None
    # functions the model may call (OpenAI's shapes; wire/tools.py): rendered through the
    # model's chat template, the output held to tool_choice's grammar
    tools: Annotated[list[Tool], Field(min_length=1, max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None  # none = "auto" with tools
    parallel_tool_calls: bool | None = None  # none = true


if TYPE_CHECKING:  # with_sampling's fields as type checkers see them: SamplingParams' own
    # declarations (tests/test_typing.py runs mypy over a user of them)
    class _SampledHead(_RequestHead, SamplingParams):  # type: ignore[misc]
        pass
else:
    _SampledHead = with_sampling(_RequestHead)


class JobRequest(_SampledHead):
    """One generation job. Exactly one of ``prompt`` or ``messages``. ``n`` > 1 asks for
    n independent samples (choices) of the same prompt in one job."""

    model_config = ConfigDict(extra="forbid", strict=True)

    priority: Annotated[int, Field(ge=-1000, le=1000)] = 0
    # The lane (jobs stream) the job rides; unset = "interactive". Workers take from the
    # higher lanes first (docs/design.md "Lanes"); priority orders jobs inside a worker.
    lane: Annotated[str, Field(pattern=r"^[a-z0-9_\-]{1,32}$")] | None = None
    # Seconds from submission until the job must be done (queue wait + generation).
    timeout_s: Annotated[float, Field(gt=0.0, le=7 * 86400)] | None = None
    metadata: dict[Annotated[Text, Field(max_length=256)],
                   Annotated[Text, Field(max_length=4096)]] = Field(default_factory=dict,
                                                                   max_length=16)

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data: Any) -> Any:
        return _openai_aliases(data) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _check(self) -> JobRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of 'prompt' or 'messages' is required")
        if isinstance(self.prompt, list):
            if not self.prompt:
                raise ValueError("prompt is empty")
            if len(self.prompt) > MAX_PROMPT_CHARS // 4:
                raise ValueError(f"prompt longer than {MAX_PROMPT_CHARS // 4} tokens")
        elif self.prompt is not None:
            if not self.prompt.strip():
                raise ValueError("prompt is empty")
            if len(self.prompt) > MAX_PROMPT_CHARS:
                raise ValueError(f"prompt longer than {MAX_PROMPT_CHARS} characters")
        if self.messages is not None:
            if not self.messages:
                raise ValueError("messages is empty")
            if sum(len(m.text) for m in self.messages) > MAX_PROMPT_CHARS:
                raise ValueError(f"messages longer than {MAX_PROMPT_CHARS} characters")
            if not any(m.text.strip() or m.tool_calls for m in self.messages):
                raise ValueError("all messages are empty")
        bad = problem(self.tools, self.tool_choice, self.guided, self.messages is not None)
        if bad:
            raise ValueError(bad)
        return self

    def body_json(self) -> str:
        return self.model_dump_json(exclude_none=True)

    @property
    def tools_active(self) -> bool:
        """Whether the output may be tool calls (tools given, tool_choice not "none")."""
        return mode(self.tools, self.tool_choice) is not None

    def output_spec(self) -> GuidedSpec | None:
        """What the output must match: ``guided``, or the tools' grammar (wire/tools.py)."""
        return output_spec(self.guided, self.tools, self.tool_choice, self.parallel_tool_calls)

    def check_output(self) -> None:
        """ValueError (one line) unless the output spec compiles (llguidance, no torch)."""
        check_output(self.guided, self.tools, self.tool_choice, self.parallel_tool_calls)


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class Choice(BaseModel):
    """One sample of an ``n`` > 1 job (the final event's and the record's ``choices``)."""

    index: int
    text: str = ""
    finish_reason: str = ""
    completion_tokens: int = 0


class JobRecord(BaseModel):
    """The job hash ``{p}:job:{id}`` as a client sees it. ``text`` is choice 0's text;
    ``choices`` lists every choice when the job asked for n > 1."""

    model_config = ConfigDict(extra="ignore")

    id: str
    status: Status
    model: str = ""
    attempt: int = 0
    worker: str = ""
    created_at: float | None = None
    started_at: float | None = None
    finished_at: float | None = None
    finish_reason: str = ""
    error: str = ""
    text: str = ""
    usage: Usage = Field(default_factory=Usage)
    choices: list[Choice] | None = None

    @property
    def done(self) -> bool:
        return self.status in TERMINAL

    @classmethod
    def from_hash(cls, job_id: str, h: dict[str, str]) -> JobRecord:
        def f(name: str) -> float | None:
            return float(h[name]) if h.get(name) else None

        return cls(
            id=job_id,
            status=h.get("status", "queued"),
            model=h.get("model", ""),
            attempt=int(h.get("attempt") or 0),
            worker=h.get("worker", ""),
            created_at=f("created_at"),
            started_at=f("started_at"),
            finished_at=f("finished_at"),
            finish_reason=h.get("finish_reason", ""),
            error=h.get("error", ""),
            text=h.get("text", ""),
            usage=Usage(
                prompt_tokens=int(h.get("prompt_tokens") or 0),
                completion_tokens=int(h.get("completion_tokens") or 0),
            ),
            choices=json.loads(h["choices"]) if h.get("choices") else None,
        )


class TopLogprob(BaseModel):
    id: int
    token: str
    logprob: float


class TokenLogprob(BaseModel):
    """Log-probability of one generated token (raw distribution, before sampling
    controls), its rank, and the ``logprobs`` most likely alternatives, best first."""

    id: int
    token: str
    logprob: float
    rank: int
    top: list[TopLogprob] = Field(default_factory=list)


class PromptLogprob(TokenLogprob):
    """A prompt token's (``prompt_logprobs``): the first token's logprob and rank are null."""

    logprob: float | None  # type: ignore[assignment]
    rank: int | None  # type: ignore[assignment]


class TokenEvent(BaseModel):
    """``finish_reason`` is set on the event carrying a choice's last token. A job's event
    0 also carries its prompt's token count and, when asked for, its prompt logprobs."""

    type: Literal["token"] = "token"
    index: int
    delta: str
    token_ids: list[int] = Field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    choice: int = 0
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    prompt_logprobs: list[PromptLogprob] | None = None


class FinalEvent(BaseModel):
    type: Literal["final"] = "final"
    index: int
    status: Status
    finish_reason: str = ""
    text: str = ""
    error: str = ""
    usage: Usage = Field(default_factory=Usage)
    choices: list[Choice] | None = None


Event = TokenEvent | FinalEvent


# ---- plain field builders/parsers (hot path: no pydantic on the worker side) ----

def clean_logprob(x: float) -> float:
    return x if math.isfinite(x) else LOGPROB_FLOOR


def token_fields(index: int, delta: str, token_ids: list[int], logprobs: Any = None,
                 choice: int | None = None, finish_reason: str | None = None) -> dict[str, str]:
    f = {"t": "token", "i": str(index), "d": delta, "ids": ",".join(map(str, token_ids))}
    if logprobs is not None:
        f["lp"] = json.dumps(logprobs)
    if choice is not None:
        f["c"] = str(choice)
    if finish_reason:
        f["fr"] = finish_reason
    return f


def final_fields(index: int, status: str, finish_reason: str, text: str, error: str,
                 prompt_tokens: int, completion_tokens: int,
                 choices: list[dict[str, Any]] | None = None) -> dict[str, str]:
    f = {"t": "final", "i": str(index), "status": status, "fr": finish_reason, "text": text,
         "err": error, "pt": str(prompt_tokens), "ct": str(completion_tokens)}
    if choices:
        f["choices"] = json.dumps(choices)
    return f


def parse_event(fields: dict[str, str]) -> Event:
    """Parse an out-stream entry (or pub/sub message dict) into an event model."""
    if fields.get("t") == "final":
        ch = fields.get("choices")
        return FinalEvent(
            index=int(fields["i"]), status=fields["status"], finish_reason=fields.get("fr", ""),
            text=fields.get("text", ""), error=fields.get("err", ""),
            usage=Usage(prompt_tokens=int(fields.get("pt") or 0),
                        completion_tokens=int(fields.get("ct") or 0)),
            choices=json.loads(ch) if ch else None,
        )
    ids, lp, plp, pt = fields.get("ids", ""), fields.get("lp"), fields.get("plp"), fields.get("pt")
    return TokenEvent(index=int(fields["i"]), delta=fields.get("d", ""),
                      token_ids=[int(x) for x in ids.split(",")] if ids else [],
                      logprobs=json.loads(lp) if lp else None,
                      choice=int(fields.get("c") or 0), finish_reason=fields.get("fr") or None,
                      prompt_tokens=int(pt) if pt else None,
                      prompt_logprobs=json.loads(plp) if plp else None)
