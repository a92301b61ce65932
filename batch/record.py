"""The batch object a client sees (OpenAI's Batch shape) and its statuses.

Counts while the batch runs come from the service's counters (exact: each job's terminal
script bumps them): ``completed`` = jobs finished normally, ``failed`` = invalid lines +
jobs that ended otherwise. A job cut by the window's end (status finished, finish_reason
deadline) is counted by the service as finished and moved to ``failed`` once the collector
has seen it (``cut``). After the end, the counts are those of the output and error files.
"""
from __future__ import annotations

import json
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, Field

from pagedq.wire.errors import JobNotFound, PagedqError


class BatchStatus(StrEnum):
    validating = "validating"
    in_progress = "in_progress"
    finalizing = "finalizing"
    completed = "completed"
    failed = "failed"
    expired = "expired"
    cancelling = "cancelling"
    cancelled = "cancelled"


BATCH_TERMINAL = frozenset({BatchStatus.completed, BatchStatus.failed, BatchStatus.expired,
                            BatchStatus.cancelled})
_TIMES = ("created_at", "in_progress_at", "finalizing_at", "completed_at", "failed_at",
          "expired_at", "cancelling_at", "cancelled_at", "expires_at")


class BatchNotFound(JobNotFound):
    """No batch record with this id (never created, or its record expired)."""


class BatchStateError(PagedqError):
    """The batch is in a status that does not allow the operation (e.g. cancel of a
    completed batch, retry of one still running)."""


class RequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class Usage(BaseModel):
    """Tokens of the batch's output lines so far (OpenAI's batch ``usage``)."""

    input_tokens: int = 0
    output_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens


class Batch(BaseModel):
    id: str
    object: str = "batch"
    endpoint: str | None = None
    model: str = ""
    status: BatchStatus
    completion_window: str = ""
    input_file: str = ""
    output_file: str = ""
    error_file: str = ""
    created_at: int | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    expires_at: int | None = None
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    usage: Usage = Field(default_factory=Usage)
    errors: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    retry_of: str | None = None
    # pagedq's detail: its rq queue, lines validated so far, lines found invalid, jobs
    # created so far, jobs ended by status
    queue: str = ""
    checked: int = 0
    invalid: int = 0
    submitted: int = 0
    jobs: dict[str, int] = Field(default_factory=dict)

    @property
    def done(self) -> bool:
        return self.status in BATCH_TERMINAL

    @classmethod
    def from_hash(cls, batch_id: str, h: dict[str, str]) -> Batch:
        def n(name: str) -> int:
            return int(h.get(name) or 0)

        if "final_completed" in h:
            completed, failed = n("final_completed"), n("final_failed")
        else:
            completed = max(0, n("completed") - n("cut"))
            failed = n("failed") + n("cut") + n("invalid")
        times = {k: int(float(h[k])) for k in _TIMES if h.get(k)}
        return cls(
            id=batch_id, model=h.get("model", ""), status=h.get("status", "validating"),
            completion_window=h.get("completion_window", ""),
            input_file=h.get("input_file", ""), output_file=h.get("output_file", ""),
            error_file=h.get("error_file", ""), **times,
            request_counts=RequestCounts(total=n("lines"), completed=completed, failed=failed),
            usage=Usage(input_tokens=n("usage_in"), output_tokens=n("usage_out")),
            errors=json.loads(h["errors"]) if h.get("errors") else None,
            metadata=json.loads(h["metadata"]) if h.get("metadata") else None,
            retry_of=h.get("retry_of") or None, queue=h.get("queue", ""), checked=n("checked"),
            invalid=n("invalid"),
            submitted=n("submitted"),
            jobs={k[2:]: int(v) for k, v in h.items() if k.startswith("n_")},
        )
