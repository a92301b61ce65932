"""OpenAI's API shapes, written once for the batch files (batch/) and the HTTP
gateway (gateway/): a request body -> JobRequest fields, a job's result -> a response body
(``text_completion`` / ``chat.completion``) and its streamed chunks. Pure: no Redis, no I/O.

Two kinds of request, by endpoint: ``completion`` (``/v1/completions``: ``prompt``, a string
or token ids) and ``chat`` (``/v1/chat/completions``: ``messages``). The rest of the body
is what ``JobRequest`` takes, OpenAI's names included (``max_completion_tokens``,
``logprobs: true`` + ``top_logprobs``, ``user``, ``stop: null``): wire/schema.py.

Invariant: every function here is deterministic in its arguments. The batch ingest parses
a line again after a crash and must get the same body (SUBMIT's idempotency), and the
gateway renders a job's event k the same way on every (re)connection (resumable streams).
"""
from __future__ import annotations

import json
from typing import Any

CHAT, COMPLETION = "chat", "completion"
ENDPOINTS = {"/v1/completions": COMPLETION, "/v1/chat/completions": CHAT}


# ---- requests

def body_problem(kind: str, data: dict[str, Any]) -> str | None:
    """What JobRequest cannot check (it knows no endpoints): the prompt field must fit the
    endpoint. Unwraps OpenAI's one-prompt lists (``["text"]``, ``[[ids]]``) in ``data``."""
    if kind == CHAT:
        if "prompt" in data:
            return "/v1/chat/completions takes messages, not prompt"
        return None
    if "messages" in data:
        return "/v1/completions takes prompt, not messages"
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        if len(prompt) != 1:
            return "one prompt per request (a list of prompts is not supported)"
        data["prompt"] = prompt[0]
    return None


# ---- whole responses

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
                  prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """A finished job as OpenAI's ``text_completion`` / ``chat.completion`` object.
    ``lps``: per choice, the ``lp`` entries of its token events (None: not asked for)."""
    return {
        "id": response_id(kind, job_id),
        "object": "chat.completion" if kind == CHAT else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice_body(kind, c, lps[c["index"]] if lps else None) for c in choices],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def choice_body(kind: str, c: dict[str, Any], lp: list[dict[str, Any]] | None) -> dict[str, Any]:
    if kind == CHAT:
        return {"index": c["index"], "message": {"role": "assistant", "content": c["text"]},
                "logprobs": None if lp is None else chat_logprobs(lp),
                "finish_reason": c["finish_reason"]}
    return {"index": c["index"], "text": c["text"],
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
            return None
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
            "top_logprobs": [{x["token"]: x["logprob"] for x in t.get("top", [])} for t in lp],
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
                 logprobs: dict[str, Any] | None = None,
                 finish_reason: str | None = None) -> dict[str, Any]:
    """A choice of a streamed chunk: a text delta (``role``: chat's first delta, which
    names the assistant), or the choice's end (``finish_reason`` with an empty delta)."""
    if kind == CHAT:
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if finish_reason is None:
            delta["content"] = text
        return {"index": index, "delta": delta, "logprobs": logprobs,
                "finish_reason": finish_reason}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
