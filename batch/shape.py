"""Job records -> OpenAI Batch output and error lines (pure: no Redis, no files).

Output line: ``{"id", "custom_id", "response": {"status_code": 200, "request_id": <job
id>, "body": <text_completion or chat.completion>}, "error": null}``. Error line:
``{"id", "custom_id", "response": null, "error": {"code", "message"}}`` (validation errors
add ``"line"``). Only a job that finished normally is an output line. ``batch_expired``:
a job cut by its deadline (status finished, finish_reason deadline), expired, cancelled
after the window's end, or failed once its deadline had passed (a worker refuses a job
it cannot prefill before its deadline). The response bodies are wire/openai_api.py's,
the same the HTTP gateway returns.
"""
from __future__ import annotations

from typing import Any

from pagedq.wire.openai_api import Echo, choices_of, prompt_head, response_body, token_logprobs
from pagedq.wire.schema import FinishReason, Status

from .lines import Line, LineError
from .lines import job_id as job_id_of

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


def invalid_line(e: LineError, batch_id: str) -> dict[str, Any]:
    """A line that never became a job: its id is the one its job would have had."""
    return error_line(e.custom_id, e.code, e.message, job_id=job_id_of(batch_id, e.line),
                      line=e.line)


def usage_of(outs: list[dict[str, Any]]) -> tuple[int, int]:
    """(prompt, completion) tokens of output lines."""
    us = [o["response"]["body"]["usage"] for o in outs]
    return sum(u["prompt_tokens"] for u in us), sum(u["completion_tokens"] for u in us)


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
    choices = choices_of(h)
    lps = token_logprobs(events, len(choices)) if events is not None and ln.logprobs else None
    # the prompt as its tokens spell it (the line's text is not at hand here)
    echo = Echo.of(None, prompt_head(events or [])[1], ln.logprobs) if ln.echo else None
    body = response_body(ln.kind, job_id, model,
                         int(float(h.get("finished_at") or h.get("created_at") or 0)), choices,
                         lps, int(h.get("prompt_tokens") or 0), int(h.get("completion_tokens") or 0),
                         ln.tools, echo)
    return {"id": request_id(job_id), "custom_id": ln.custom_id,
            "response": {"status_code": 200, "request_id": job_id, "body": body},
            "error": None}
