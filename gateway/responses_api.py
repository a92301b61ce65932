"""OpenAI's Responses API (``POST /v1/responses``) as pagedq jobs: a request body -> the
chat a job runs (pure: no Redis, no I/O), a job's result -> the ``response`` object.

Served: ``input`` (text, or items: messages with text parts, ``function_call`` and
``function_call_output`` items), ``instructions`` (a system message first),
``max_output_tokens``, ``temperature``, ``top_p``, ``top_logprobs``, function ``tools``,
``tool_choice``, ``parallel_tool_calls``, ``text.format`` (text, json_object, json_schema:
wire/openai_fields.py ``response_format``), ``metadata``, ``user``, ``store`` and
``previous_response_id`` (a stored response's chat and output come before ``input``), and
pagedq's sampling extras (``seed``, ``stop``, ``ignore_eos``, ``top_k``, ...) as on chat.
Ignored (they cannot change the output): ``service_tier``, ``prompt_cache_*``,
``safety_identifier``, ``reasoning``, ``truncation``, ``text.verbosity``,
``stream_options.include_obfuscation``, ``include`` items other than
``message.output_text.logprobs`` (served: the output text's logprobs; the others name
outputs pagedq never makes). Refused, a 400
naming the field: built-in tools (web search, file search, computer use, code
interpreter, MCP, image generation), image, file and audio inputs, ``background``,
``conversation``, ``prompt`` (templates), ``max_tool_calls``, ``moderation``,
``item_reference`` items.

A job's output is a ``message`` item (its text as one ``output_text`` part) or, when its
tools were active and its text is complete calls (wire/tools.py), one ``function_call``
item per call (``call_id`` as on chat: made from the job id). Deterministic in its inputs.
"""
from __future__ import annotations

import json
from typing import Any

from pagedq.wire.openai_api import chat_logprobs
from pagedq.wire.openai_fields import FieldError, response_format
from pagedq.wire.schema import JobRecord, Status
from pagedq.wire.tools import call_id, calls_of

IGNORED = ("service_tier", "prompt_cache_key", "prompt_cache_options",
           "prompt_cache_retention", "safety_identifier", "reasoning", "truncation", "include")
REFUSED = {"background": "background responses are not served",
           "conversation": "conversations are not served: send previous_response_id",
           "prompt": "prompt templates are not served",
           "max_tool_calls": "max_tool_calls is not served",
           "moderation": "moderation is not served"}
# what a response repeats of its request (and a stored one keeps)
ECHOED = ("instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice",
          "parallel_tool_calls", "text", "metadata", "previous_response_id", "user",
          "top_logprobs")
LOGPROBS_ITEM = "message.output_text.logprobs"
PREFIX = "resp_"


def job_of(response_id: str) -> str | None:
    return response_id[len(PREFIX):] if response_id.startswith(PREFIX) else None


def request_fields(body: dict[str, Any], history: list[dict[str, Any]] | None
                   ) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
    """(JobRequest fields of the job, what the response repeats of the request, the
    chat without its instructions: what a stored response keeps) of a body whose
    ``model``, ``stream``, ``store``, ``stream_options`` and ``pagedq`` were taken out;
    ``history``: the chat of ``previous_response_id`` (its messages and output). FieldError
    naming the field if invalid."""
    data = dict(body)
    include = data.get("include") or []
    if not (isinstance(include, list) and all(isinstance(x, str) for x in include)):
        raise FieldError("include", "include must be a list of strings")
    if LOGPROBS_ITEM in include:  # the output text's logprobs, without alternatives unless
        data.setdefault("top_logprobs", 0)  # top_logprobs asks for some
    for name in IGNORED:
        data.pop(name, None)
    for name, why in REFUSED.items():
        if data.get(name) not in (None, False):
            raise FieldError(name, why)
        data.pop(name, None)
    echoed = {k: data.get(k) for k in ECHOED}
    for name in ("messages", "prompt", "n", "response_format", "max_tokens", "logprobs",
                 "max_completion_tokens"):
        if name in data:
            raise FieldError(name, f"{name} is not a field of the Responses API")
    chat = [*(history or []), *input_messages(data.pop("input", None))]
    instructions = data.pop("instructions", None)
    if instructions is not None and not isinstance(instructions, str):
        raise FieldError("instructions", "instructions must be a string")
    data["messages"] = ([{"role": "system", "content": instructions}] if instructions else
                        []) + chat
    data.pop("previous_response_id", None)
    if "max_output_tokens" in data:
        data["max_tokens"] = data.pop("max_output_tokens")
    if "top_logprobs" in data:
        data["logprobs"] = data.pop("top_logprobs")
    if "tools" in data:
        data["tools"] = [_tool(t, i) for i, t in enumerate(data["tools"] or [])]
    if "tool_choice" in data:
        data["tool_choice"] = _tool_choice(data["tool_choice"])
    text = data.pop("text", None)
    if text is not None:
        if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
            raise FieldError("text", "text takes format and verbosity")
        fmt = text.get("format")
        if fmt is not None:
            try:
                data["response_format"] = _format(fmt)
            except ValueError as e:
                raise FieldError("text.format", str(e)) from None
    return data, echoed, chat


def input_messages(value: Any) -> list[dict[str, Any]]:
    """``input`` -> chat messages (consecutive function_call items make one assistant
    message with their tool_calls)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise FieldError("input", "input must be a string or a list of items")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise FieldError(f"input.{i}", "an input item must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            out.append({"role": item.get("role"), "content": _text(item.get("content"), i)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str) else _text(output, i)})
        elif kind != "reasoning":  # (a reasoning item of another server: nothing to say)
            raise FieldError(f"input.{i}.type", f"input items of type {kind!r} are not served")
    return out


def _text(content: Any, i: int) -> Any:
    """A message's content: a string, or its text parts joined (other parts: 400)."""
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        if not (isinstance(part, dict) and part.get("type") in ("input_text", "output_text",
                                                                 "text")):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise FieldError(f"input.{i}.content", f"content parts of type {kind!r} are not "
                             "served (text only)")
        texts.append(part.get("text"))
    return "\n".join(t for t in texts if isinstance(t, str))


def _tool(t: Any, i: int) -> dict[str, Any]:
    if not isinstance(t, dict) or t.get("type") != "function":
        kind = t.get("type") if isinstance(t, dict) else None
        raise FieldError(f"tools.{i}", f"tools of type {kind!r} are not served (function "
                         "tools only)")
    fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
    extra = set(t) - {"type", *fn}
    if extra:
        raise FieldError(f"tools.{i}", f"unknown fields {sorted(extra)}")
    return {"type": "function", "function": fn}


def _tool_choice(c: Any) -> Any:
    if isinstance(c, dict):
        if c.get("type") != "function" or set(c) != {"type", "name"}:
            raise FieldError("tool_choice", "tool_choice must be \"auto\", \"none\", "
                             "\"required\" or {\"type\": \"function\", \"name\"}")
        return {"type": "function", "function": {"name": c["name"]}}
    return c


def _format(fmt: Any) -> dict[str, Any]:
    """``text.format`` -> chat's response_format (checked by response_format)."""
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        js = {k: v for k, v in fmt.items() if k != "type"}
        rf = {"type": "json_schema", "json_schema": js}
    else:
        rf = fmt
    response_format(rf)
    return rf


# ---- the response object

def usage(rec: JobRecord) -> dict[str, Any]:
    i, o = rec.usage.prompt_tokens, rec.usage.completion_tokens
    return {"input_tokens": i, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": o, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": i + o}


def message_item(job_id: str, text: str, status: str,
                 lps: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "message", "id": f"msg_{job_id}", "status": status, "role": "assistant",
            "content": [output_text(text, lps)]}


def output_text(text: str, lps: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [],
            "logprobs": chat_logprobs(lps)["content"] if lps else []}


def call_item(job_id: str, k: int, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{job_id}_{k}", "call_id": call_id(job_id, 0, k),
            "name": name, "arguments": arguments, "status": status}


def output_items(job_id: str, rec: JobRecord, tools: bool,
                 lps: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """A finished (or cancelled) job's output items."""
    calls = calls_of(rec.text) if tools and rec.finish_reason == "stop" else None
    if calls:
        return [call_item(job_id, k, n, a, "completed") for k, (n, a) in enumerate(calls)]
    return [message_item(job_id, rec.text, "completed" if rec.finish_reason == "stop"
                         else "incomplete", lps)]


def status_of(rec: JobRecord) -> tuple[str, dict[str, Any] | None, dict[str, Any] | None]:
    """(status, incomplete_details, error) of a job as a response."""
    if rec.status in (Status.queued, Status.running):
        return "in_progress", None, None
    if rec.status == Status.cancelled:
        return "cancelled", None, None
    if rec.status != Status.finished:
        why = rec.error or ("no worker served the model" if rec.finish_reason == "no_worker"
                            else "the job's timeout_s ran out before it started"
                            if rec.status == Status.expired else "the job failed")
        return "failed", None, {"code": "server_error", "message": why}
    if rec.finish_reason in ("length", "deadline"):
        reason = "max_output_tokens" if rec.finish_reason == "length" else "deadline"
        return "incomplete", {"reason": reason}, None
    return "completed", None, None


def response_object(job_id: str, model: str, created: int, echoed: dict[str, Any],
                    store: bool, status: str, output: list[dict[str, Any]],
                    usage_: dict[str, Any] | None, incomplete: dict[str, Any] | None = None,
                    error: dict[str, Any] | None = None) -> dict[str, Any]:
    text = echoed.get("text") or {"format": {"type": "text"}}
    return {
        "id": PREFIX + job_id, "object": "response", "created_at": created, "status": status,
        "background": False, "error": error, "incomplete_details": incomplete,
        "instructions": echoed.get("instructions"),
        "max_output_tokens": echoed.get("max_output_tokens"), "model": model,
        "output": output, "parallel_tool_calls": echoed.get("parallel_tool_calls") is not False,
        "previous_response_id": echoed.get("previous_response_id"), "reasoning": None,
        "service_tier": "default", "store": store,
        "temperature": echoed.get("temperature") if echoed.get("temperature") is not None
        else 1.0,
        "text": text, "tool_choice": echoed.get("tool_choice") or "auto",
        "tools": echoed.get("tools") or [],
        "top_logprobs": echoed.get("top_logprobs"),
        "top_p": echoed.get("top_p") if echoed.get("top_p") is not None else 1.0,
        "truncation": "disabled", "usage": usage_, "user": echoed.get("user"),
        "metadata": echoed.get("metadata") or {},
    }


def history_of(stored: dict[str, Any], job_id: str, rec: JobRecord) -> list[dict[str, Any]]:
    """The chat a stored response leaves to one that names it (``previous_response_id``):
    its chat, then its output as the assistant's message."""
    calls = calls_of(rec.text) if stored.get("tools_active") else None
    if calls:
        reply = {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id(job_id, 0, k), "type": "function",
             "function": {"name": n, "arguments": a}} for k, (n, a) in enumerate(calls)]}
    else:
        reply = {"role": "assistant", "content": rec.text}
    return [*stored["chat"], reply]


def stored_json(echoed: dict[str, Any], chat: list[dict[str, Any]], tools_active: bool,
                model: str) -> str:
    """What a stored response keeps in its job's record (field ``resp``)."""
    return json.dumps({"echoed": echoed, "chat": chat, "tools_active": tools_active,
                       "model": model}, separators=(",", ":"))
