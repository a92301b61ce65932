"""OpenAI's API shapes, written once for the batch files (batch/) and the HTTP
gateway (gateway/): a request body -> JobRequest fields, a job's result -> a response body
(``text_completion`` / ``chat.completion``) and its streamed chunks. Pure: no Redis, no I/O.

Two kinds of request, by endpoint: ``completion`` (``/v1/completions``: ``prompt``, a string
or token ids) and ``chat`` (``/v1/chat/completions``: ``messages``). The rest of the body
is what ``JobRequest`` takes, OpenAI's names included (``max_completion_tokens``,
``logprobs: true`` + ``top_logprobs``, ``user``, ``stop: null``, ``response_format``,
``tools``, ``tool_choice``, ``parallel_tool_calls``, ``logit_bias``): wire/schema.py; the
other fields of OpenAI's reference are ignored or refused by wire/openai_fields.py.
Completions take a list of prompts (a job each) and ``echo`` (``shape``).

A chat whose tools are active (wire/tools.py) answers the calls its output holds as
OpenAI's ``tool_calls`` (ids from ``call_id``, arguments as JSON text, finish reason
``tool_calls``); any other output is its text, as without tools.

Invariant: every function here is deterministic in its arguments. The batch ingest parses
a line again after a crash and must get the same body (SUBMIT's idempotency), and the
gateway renders a job's event k the same way on every (re)connection (resumable streams).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagedq.wire.openai_fields import CHAT, COMPLETION, FieldError, check
from pagedq.wire.tools import CallScanner, call_id, calls_of

ENDPOINTS = {"/v1/completions": COMPLETION, "/v1/chat/completions": CHAT}


# ---- requests

@dataclass(frozen=True, slots=True)
class Shape:
    """What a body asks of its endpoint beyond one JobRequest: completions' prompts (a list
    of several is one job each: ``prompts``; chat: ``[None]``, the messages are in the
    body) and ``echo`` (the prompt before each choice's text, and its log-probabilities
    before the output's when ``logprobs`` is asked: the jobs ask ``prompt_logprobs``)."""

    prompts: list[Any]
    echo: bool = False


def shape(kind: str, data: dict[str, Any]) -> Shape:
    """Check what JobRequest cannot (it knows no endpoints) and sort OpenAI's fields
    (wire/openai_fields.py), in place: the prompt field must fit the endpoint; ``prompt``
    and ``echo`` are taken out of ``data``. FieldError (naming the field) if invalid."""
    check(kind, data)
    if kind == CHAT:
        if "prompt" in data:
            raise FieldError("prompt", "/v1/chat/completions takes messages, not prompt")
        for name in ("echo", "prompt_logprobs"):
            if name in data:
                raise FieldError(name, f"{name} is served by /v1/completions only")
        return Shape([None])
    if "messages" in data:
        raise FieldError("messages", "/v1/completions takes prompt, not messages")
    echo = data.pop("echo", False)
    if not isinstance(echo, bool):
        raise FieldError("echo", "echo must be true or false")
    if data.get("prompt_logprobs") is not None and not echo:
        raise FieldError("prompt_logprobs", "a prompt's log-probabilities are served by "
                         "/v1/completions with echo: true and logprobs")
    if echo:
        lp = data.get("logprobs")
        want = lp if isinstance(lp, int) and not isinstance(lp, bool) else 0
        if data.setdefault("prompt_logprobs", want) != want:
            raise FieldError("prompt_logprobs", "with echo, prompt_logprobs is logprobs")
    prompt = data.pop("prompt", None)
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        return Shape(prompt, echo)  # several prompts (strings, or token-id lists)
    return Shape([prompt], echo)  # one: text, token ids (or a bad value JobRequest names)


# ---- whole responses# ---- whole responses

def response_id(kind: str, job_id: str) -> str:
    return ("chatcmpl-" if kind == CHAT else "cmpl-") + job_id


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def choices_of(h: dict[str, str]) -> list[dict[str, Any]]:
    """A job hash's choices (``index``, ``text``, ``finish_reason``): its ``choices`` JSON
    (n > 1), else choice 0 from ``text`` and ``finish_reason``."""
    if h.get("choices"):
        return json.loads(h["choices"])
    return [{"index": 0, "text": h.get("text", ""), "finish_reason": h.get("finish_reason", "")}]


def response_body(kind: str, job_id: str, model: str, created: int,
                  choices: list[dict[str, Any]], lps: list[list[dict[str, Any]]] | None,
                  prompt_tokens: int, completion_tokens: int,
                  tools: bool = False, echo: Echo | None = None) -> dict[str, Any]:
    """A finished job as OpenAI's ``text_completion`` / ``chat.completion`` object.
    ``lps``: per choice, the ``lp`` entries of its token events (None: not asked for).
    ``tools``: the job's tools were active (its output may be calls). ``echo``: what each
    choice repeats of the prompt."""
    return {
        "id": response_id(kind, job_id),
        "object": "chat.completion" if kind == CHAT else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice_body(kind, c, lps[c["index"]] if lps else None,
                                job_id if tools else None, echo) for c in choices],
        "usage": usage(prompt_tokens, completion_tokens),
    }


@dataclass(frozen=True, slots=True)
class Echo:
    """A completion's prompt as its choices repeat it (``echo``): its text and, when the
    request asked for logprobs, its entries (a job's event-0 ``plp``: the first has a null
    logprob), which come before the output's."""

    text: str
    entries: list[dict[str, Any]] | None = None

    @classmethod
    def of(cls, prompt: str | None, entries: list[dict[str, Any]] | None,
           logprobs: bool) -> Echo:
        """``prompt``: the request's text (None: it sent token ids, spelled by their
        tokens' texts, as is the whole prompt where no text is at hand)."""
        text = prompt if isinstance(prompt, str) else "".join(e["token"] for e in entries or [])
        return cls(text, entries if logprobs else None)


def prompt_head(events: list[dict[str, str]]) -> tuple[int | None, list[dict[str, Any]] | None]:
    """(prompt tokens, prompt logprobs entries) of a job's event 0 among its log's entries
    (None where absent: not asked for, or the log was trimmed)."""
    for ev in events[:1]:
        if ev.get("i") == "0" and ev.get("t") == "token":
            return (int(ev["pt"]) if ev.get("pt") else None,
                    json.loads(ev["plp"]) if ev.get("plp") else None)
    return None, None


def tool_calls_body(job_id: str, choice: int, calls: list[tuple[str, str]]
                    ) -> list[dict[str, Any]]:
    return [{"id": call_id(job_id, choice, k), "type": "function",
             "function": {"name": name, "arguments": args}}
            for k, (name, args) in enumerate(calls)]


def finish_reason_of(text: str, reason: str, tools: bool) -> str:
    """OpenAI's finish reason of a choice: ``tool_calls`` when its tools were active and
    its output is complete calls (the grammar ended it: stop)."""
    if tools and reason == "stop" and calls_of(text):
        return "tool_calls"
    return reason


def choice_body(kind: str, c: dict[str, Any], lp: list[dict[str, Any]] | None,
                tools_job: str | None = None, echo: Echo | None = None) -> dict[str, Any]:
    """``tools_job``: the job id of a job whose tools were active (None: none were);
    ``echo``: a completion's prompt, repeated before its text (and logprobs)."""
    if kind == CHAT:
        message: dict[str, Any] = {"role": "assistant", "content": c["text"]}
        reason = c["finish_reason"]
        calls = calls_of(c["text"]) if tools_job is not None else None
        if calls and reason == "stop":
            message = {"role": "assistant", "content": None,
                       "tool_calls": tool_calls_body(tools_job, c["index"], calls)}
            reason = "tool_calls"
        return {"index": c["index"], "message": message,
                "logprobs": None if lp is None else chat_logprobs(lp),
                "finish_reason": reason}
    if echo is not None:
        lp = None if lp is None else [*(echo.entries or []), *lp]
    return {"index": c["index"], "text": c["text"] if echo is None else echo.text + c["text"],
            "logprobs": None if lp is None else completion_logprobs(lp),
            "finish_reason": c["finish_reason"]}


def token_logprobs(events: list[dict[str, str]], n: int) -> list[list[dict[str, Any]]] | None:
    """Per choice, the ``lp`` entries of a job's token events (out-stream entries, in order);
    None when the log does not start at event 0 (trimmed) or lacks them."""
    if not events or int(events[0].get("i", -1)) != 0:
        return None
    out: list[list[dict[str, Any]]] = [[] for _ in range(n)]
    for ev in events:
        if ev.get("t") != "token":
            continue
        if "lp" not in ev:
            if ev.get("ids"):
                return None
            continue  # an event of no token (max_tokens 0) has no entries
        c = int(ev.get("c") or 0)
        if c < n:
            out[c].extend(json.loads(ev["lp"]))
    return out


def chat_logprobs(lp: list[dict[str, Any]]) -> dict[str, Any]:
    def entry(t: dict[str, Any]) -> dict[str, Any]:
        return {"token": t["token"], "logprob": t["logprob"], "bytes": list(t["token"].encode())}
    return {"content": [{**entry(t), "top_logprobs": [entry(x) for x in t.get("top", [])]}
                        for t in lp], "refusal": None}


def completion_logprobs(lp: list[dict[str, Any]], start: int = 0) -> dict[str, Any]:
    """``start``: the text offset of the first token (a stream's chunk continues the
    offsets of the chunks before it)."""
    offsets, pos = [], start
    for t in lp:
        offsets.append(pos)
        pos += len(t["token"])
    return {"tokens": [t["token"] for t in lp], "token_logprobs": [t["logprob"] for t in lp],
            "top_logprobs": [None if t["logprob"] is None  # a prompt's first token
                             else {x["token"]: x["logprob"] for x in t.get("top", [])}
                             for t in lp],
            "text_offset": offsets}


# ---- streamed chunks

def chunk(kind: str, job_id: str, model: str, created: int, choices: list[dict[str, Any]],
          with_usage: bool = False, usage_: dict[str, int] | None = None) -> dict[str, Any]:
    """One streamed chunk (``chat.completion.chunk`` / ``text_completion``). ``with_usage``
    (the request's ``stream_options.include_usage``): every chunk has a ``usage`` key,
    null except on the last one, which has no choices."""
    c: dict[str, Any] = {
        "id": response_id(kind, job_id),
        "object": "chat.completion.chunk" if kind == CHAT else "text_completion",
        "created": created, "model": model, "choices": choices}
    if with_usage:
        c["usage"] = usage_
    return c


def chunk_choice(kind: str, index: int, text: str = "", *, role: bool = False,
                 logprobs: dict[str, Any] | None = None, finish_reason: str | None = None,
                 tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A choice of a streamed chunk: a text delta (``role``: chat's first delta, which
    names the assistant), tool-call deltas (``tool_calls``: ``CallStream``'s; [] = none
    yet), or the choice's end (``finish_reason`` with an empty delta)."""
    if kind == CHAT:
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if tool_calls:
            delta["tool_calls"] = tool_calls
        elif finish_reason is None and tool_calls is None:
            delta["content"] = text
        return {"index": index, "delta": delta, "logprobs": logprobs,
                "finish_reason": finish_reason}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


class CallStream:
    """One chat choice's streamed output when its tools are active: text until its first
    character says it is calls ("[": wire/tools.py), then OpenAI's tool-call deltas, the
    first of each call with its id, type and name, then its arguments' text as it comes.
    Deterministic in the deltas fed, in order (a resumed stream feeds the earlier ones)."""

    __slots__ = ("job_id", "choice", "calls", "scanner")

    def __init__(self, job_id: str, choice: int) -> None:
        self.job_id, self.choice = job_id, choice
        self.calls: bool | None = None  # None: nothing seen yet
        self.scanner = CallScanner()

    def feed(self, delta: str) -> list[dict[str, Any]] | None:
        """The tool-call deltas of ``delta`` ([] when none is complete yet), or None when
        the output is text (send ``delta`` as content)."""
        if self.calls is None and delta:
            self.calls = delta.startswith("[")
        if not self.calls:
            return None
        out = []
        for k, new, text in self.scanner.feed(delta):
            if new:
                out.append({"index": k, "id": call_id(self.job_id, self.choice, k),
                            "type": "function",
                            "function": {"name": self.scanner.calls[k][0], "arguments": text}})
            elif text:
                out.append({"index": k, "function": {"arguments": text}})
        return out
