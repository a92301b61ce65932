"""HTTP errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with
OpenAI's status codes (docs/gateway.md has the table)."""
from __future__ import annotations

import json
import logging
from typing import Any

import redis

from pagedq.wire.errors import (
    InvalidRequest,
    JobConflict,
    JobNotFound,
    NoWorker,
    Overloaded,
    ResultTimeout,
    StorageFull,
)

# status -> OpenAI's error type
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          409: "conflict_error", 413: "invalid_request_error", 429: "rate_limit_error",
          500: "server_error", 503: "service_unavailable", 504: "timeout_error"}


class APIError(Exception):
    """An error response. ``retry_after``: seconds, sent as the Retry-After header."""

    def __init__(self, status: int, message: str, code: str | None = None,
                 param: str | None = None, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}

    def json_bytes(self) -> bytes:
        return json.dumps(self.body()).encode()

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}


def bad_request(message: str, param: str | None = None, code: str = "invalid_request") -> APIError:
    return APIError(400, message, code, param)


def not_found(message: str, code: str = "not_found") -> APIError:
    return APIError(404, message, code)


def from_pagedq(e: Exception, overloaded_retry_after: int = 1) -> APIError | None:
    """A producer error -> its HTTP error; None for an error that is not one of them.
    (NoWorker is the caller's: 404 or 503 depends on whether the model was ever served.)"""
    if isinstance(e, InvalidRequest):
        msg = str(e).removeprefix("invalid job request: ")
        return bad_request(msg, _param_of(msg))
    if isinstance(e, StorageFull):  # (an Overloaded: Redis itself is full, not the queue)
        return APIError(503, f"the queue's storage is full, retry later ({e})", "storage_full",
                        retry_after=5)
    if isinstance(e, Overloaded):
        return APIError(429, f"the queue is full, retry later ({e})", "overloaded",
                        retry_after=overloaded_retry_after)
    if isinstance(e, JobConflict):
        return APIError(409, str(e), "job_conflict")
    if isinstance(e, JobNotFound):
        return not_found(f"job not found (never submitted, or expired): {e.args[0] if e.args else ''}",
                         "job_not_found")
    if isinstance(e, ResultTimeout):
        return APIError(504, str(e), "timeout")
    if isinstance(e, NoWorker):
        return APIError(503, str(e), "no_worker")
    if isinstance(e, redis.exceptions.NoPermissionError):  # set-up, not an outage: say so
        logging.getLogger("pagedq.gateway").error("redis_permission_denied error=%s", e)
        return APIError(500, "the gateway's Redis user may not serve this request (its ACL: "
                        "docs/security.md, \"The gateway\")", "permission_denied")
    if isinstance(e, redis.RedisError):  # the clients retried for PAGEDQ_CLIENT_RETRY_S
        return APIError(503, "the queue (Redis) is unavailable; retry later", "unavailable",
                        retry_after=5)
    return None


def _param_of(msg: str) -> str | None:
    """The field a validation message names first (``"max_tokens: Input should ..."``)."""
    head = msg.split(":", 1)[0]
    return head if head and " " not in head else None
