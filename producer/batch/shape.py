"""Job records -> OpenAI Batch output and error lines (pure: no Redis, no files).

Output line: ``{"id", "custom_id", "response": {"status_code": 200, "request_id": <job
id>, "body": <text_completion or chat.completion>}, "error": null}``. Error line:
``{"id", "custom_id", "response": null, "error": {"code", "message"}}`` (validation errors
add ``"line"``). Only a job that finished normally is an output line. ``batch_expired``:
a job cut by its deadline (status finished, finish_reason deadline), expired, cancelled
after the window's end, or failed once its deadline had passed (a worker refuses a job
it cannot prefill before its deadline).
"""
from __future__ import annotations

import json
from typing import Any

from ..schema import FinishReason, Status
from .lines import Line, LineError

# error codes of lines that were valid but produced no output
EXPIRED, CANCELLED = "batch_expired", "batch_cancelled"


def request_id(job_id: str) -> str:
    return f"batch_req_{job_id}"


def error_line(custom_id: str | None, code: str, message: str, *, job_id: str | None = None,
               line: int | None = None) -> dict[str, Any]:
    err: dict[str, Any] = {"code": code, "message": message}
    if line is not None:
        err["line"] = line
    return {"id": request_id(job_id) if job_id else None, "custom_id": custom_id,
            "response": None, "error": err}


def invalid_line(e: LineError) -> dict[str, Any]:
    return error_line(e.custom_id, e.code, e.message, line=e.line)


def outcome(ln: Line, job_id: str, h: dict[str, str], model: str, *, batch_cancelled: bool,
            expires_at: float, events: list[dict[str, str]] | None = None
            ) -> tuple[bool, dict[str, Any], bool]:
    """(is output, the line, ``cut``): ``cut`` marks a job the service counted as
    completed (status finished) that the batch reports as an error (its deadline cut it)."""
    if not h:
        return False, error_line(ln.custom_id, "result_missing",
                                 "the job's record is gone (expired after the result TTL)",
                                 job_id=job_id), False
    status, reason = h.get("status", ""), h.get("finish_reason", "")
    if status == Status.finished and reason != FinishReason.deadline:
        return True, result_line(ln, job_id, h, model, events), False
    if status == Status.finished:
        return False, error_line(ln.custom_id, EXPIRED, "the completion window ran out while "
                                 "the request ran; its partial output is discarded",
                                 job_id=job_id), True
    if status == Status.expired:
        if reason == FinishReason.no_worker:
            return False, error_line(ln.custom_id, "no_worker", "no worker served the model",
                                     job_id=job_id), False
        return False, error_line(ln.custom_id, EXPIRED, "the completion window ran out before "
                                 "the request started", job_id=job_id), False
    if status == Status.cancelled:
        ended = float(h.get("finished_at") or 0)
        code = CANCELLED if batch_cancelled else EXPIRED if ended >= expires_at else "cancelled"
        return False, error_line(ln.custom_id, code, "the request was cancelled",
                                 job_id=job_id), False
    error = h.get("error") or "the job failed"
    if _for_want_of_time(h, error):
        return False, error_line(ln.custom_id, EXPIRED, "the completion window ran out: "
                                 + error, job_id=job_id), False
    return False, error_line(ln.custom_id, "job_failed", error, job_id=job_id), False


def _for_want_of_time(h: dict[str, str], error: str) -> bool:
    """A job that failed at or after its deadline (the window's end). (A job the worker
    cannot prefill before its deadline ends ``expired``/``deadline``, handled above.)"""
    deadline = float(h.get("deadline") or 0)
    return bool(deadline) and float(h.get("finished_at") or 0) >= deadline


def result_line(ln: Line, job_id: str, h: dict[str, str], model: str,
                events: list[dict[str, str]] | None = None) -> dict[str, Any]:
    if h.get("choices"):
        choices = json.loads(h["choices"])
    else:
        choices = [{"index": 0, "text": h.get("text", ""),
                    "finish_reason": h.get("finish_reason", "")}]
    lps = token_logprobs(events, len(choices)) if events is not None else None
    pt, ct = int(h.get("prompt_tokens") or 0), int(h.get("completion_tokens") or 0)
    body: dict[str, Any] = {
        "id": ("chatcmpl-" if ln.kind == "chat" else "cmpl-") + job_id,
        "object": "chat.completion" if ln.kind == "chat" else "text_completion",
        "created": int(float(h.get("finished_at") or h.get("created_at") or 0)),
        "model": model,
        "choices": [_choice(ln.kind, c, lps[c["index"]] if lps else None) for c in choices],
        "usage": {"prompt_tokens": pt, "completion_tokens": ct, "total_tokens": pt + ct},
    }
    return {"id": request_id(job_id), "custom_id": ln.custom_id,
            "response": {"status_code": 200, "request_id": job_id, "body": body},
            "error": None}


def _choice(kind: str, c: dict[str, Any], lp: list[dict[str, Any]] | None) -> dict[str, Any]:
    if kind == "chat":
        return {"index": c["index"], "message": {"role": "assistant", "content": c["text"]},
                "logprobs": None if lp is None else _chat_logprobs(lp),
                "finish_reason": c["finish_reason"]}
    return {"index": c["index"], "text": c["text"],
            "logprobs": None if lp is None else _completion_logprobs(lp),
            "finish_reason": c["finish_reason"]}


def token_logprobs(events: list[dict[str, str]], n: int) -> list[list[dict[str, Any]]] | None:
    """Per choice, the ``lp`` entries of the job's token events in order; None when the
    log does not start at event 0 (trimmed) or lacks them."""
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


def _chat_logprobs(lp: list[dict[str, Any]]) -> dict[str, Any]:
    def entry(t: dict[str, Any]) -> dict[str, Any]:
        return {"token": t["token"], "logprob": t["logprob"], "bytes": list(t["token"].encode())}
    return {"content": [{**entry(t), "top_logprobs": [entry(x) for x in t.get("top", [])]}
                        for t in lp], "refusal": None}


def _completion_logprobs(lp: list[dict[str, Any]]) -> dict[str, Any]:
    offsets, pos = [], 0
    for t in lp:
        offsets.append(pos)
        pos += len(t["token"])
    return {"tokens": [t["token"] for t in lp], "token_logprobs": [t["logprob"] for t in lp],
            "top_logprobs": [{x["token"]: x["logprob"] for x in t.get("top", [])} for t in lp],
            "text_offset": offsets}
