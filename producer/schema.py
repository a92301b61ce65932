"""The wire schema (version 1): job requests, job records and events.

pydantic validates at the boundary (submit, worker intake, client reads). The worker's
hot path builds event field dicts with the plain functions at the bottom, never models.
"""
from __future__ import annotations

import json
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

SCHEMA_VERSION = 1
MAX_TOKENS_LIMIT = 32768
MAX_PROMPT_CHARS = 1_000_000
MAX_STOP_STRINGS = 16


class Status(StrEnum):
    queued = "queued"
    running = "running"
    finished = "finished"
    failed = "failed"
    cancelled = "cancelled"
    expired = "expired"


TERMINAL = frozenset({Status.finished, Status.failed, Status.cancelled, Status.expired})


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "tool"]
    content: str


class JobRequest(BaseModel):
    """One generation job. Exactly one of ``prompt`` or ``messages``."""

    model_config = ConfigDict(extra="forbid")

    v: Literal[1] = SCHEMA_VERSION
    id: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:\-]{1,128}$")] | None = None
    model: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,128}$")] = "smollm2"
    # text, or token ids (as OpenAI's completions API allows) for clients that tokenize
    prompt: str | list[Annotated[int, Field(ge=0, lt=2**31)]] | None = None
    messages: list[ChatMessage] | None = None
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)] = 128
    temperature: Annotated[float, Field(ge=0.0, le=100.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = -1
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] = 1.0
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    stop: list[Annotated[str, Field(min_length=1, max_length=256)]] = Field(
        default_factory=list, max_length=MAX_STOP_STRINGS
    )
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list, max_length=64)
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    priority: Annotated[int, Field(ge=-1000, le=1000)] = 0
    # Seconds from submission until the job must be done (queue wait + generation).
    timeout_s: Annotated[float, Field(gt=0.0, le=7 * 86400)] | None = None
    metadata: dict[str, str] = Field(default_factory=dict, max_length=16)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

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
            if sum(len(m.content) for m in self.messages) > MAX_PROMPT_CHARS:
                raise ValueError(f"messages longer than {MAX_PROMPT_CHARS} characters")
            if not any(m.content.strip() for m in self.messages):
                raise ValueError("all messages are empty")
        if self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must not exceed max_tokens")
        return self

    def body_json(self) -> str:
        return self.model_dump_json(exclude_none=True)


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class JobRecord(BaseModel):
    """The job hash ``{p}:job:{id}`` as a client sees it."""

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
        )


class TokenEvent(BaseModel):
    type: Literal["token"] = "token"
    index: int
    delta: str
    token_ids: list[int] = Field(default_factory=list)
    logprobs: list[Any] | None = None


class FinalEvent(BaseModel):
    type: Literal["final"] = "final"
    index: int
    status: Status
    finish_reason: str = ""
    text: str = ""
    error: str = ""
    usage: Usage = Field(default_factory=Usage)


Event = TokenEvent | FinalEvent


# ---- plain field builders/parsers (hot path: no pydantic on the worker side) ----

def token_fields(index: int, delta: str, token_ids: list[int], logprobs: Any = None) -> dict[str, str]:
    f = {"t": "token", "i": str(index), "d": delta, "ids": ",".join(map(str, token_ids))}
    if logprobs is not None:
        f["lp"] = json.dumps(logprobs)
    return f


def final_fields(index: int, status: str, finish_reason: str, text: str, error: str,
                 prompt_tokens: int, completion_tokens: int) -> dict[str, str]:
    return {"t": "final", "i": str(index), "status": status, "fr": finish_reason, "text": text,
            "err": error, "pt": str(prompt_tokens), "ct": str(completion_tokens)}


def parse_event(fields: dict[str, str]) -> Event:
    """Parse an out-stream entry (or pub/sub message dict) into an event model."""
    if fields.get("t") == "final":
        return FinalEvent(
            index=int(fields["i"]), status=fields["status"], finish_reason=fields.get("fr", ""),
            text=fields.get("text", ""), error=fields.get("err", ""),
            usage=Usage(prompt_tokens=int(fields.get("pt") or 0),
                        completion_tokens=int(fields.get("ct") or 0)),
        )
    ids = fields.get("ids", "")
    lp = fields.get("lp")
    return TokenEvent(index=int(fields["i"]), delta=fields.get("d", ""),
                      token_ids=[int(x) for x in ids.split(",")] if ids else [],
                      logprobs=json.loads(lp) if lp else None)
