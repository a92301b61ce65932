"""Typed errors a producer may catch. All derive from PagedqError."""
from __future__ import annotations


class PagedqError(Exception):
    """Base of every pagedq client error."""


class InvalidRequest(PagedqError, ValueError):
    """The job request failed validation; nothing was enqueued."""


class JobConflict(PagedqError):
    """A job id was reused with a different request body."""


class JobNotFound(PagedqError, KeyError):
    """No job record exists for this id (never submitted, or expired after its TTL)."""


class Overloaded(PagedqError):
    """The queue is past its configured caps; retry later. Nothing was enqueued."""


class StorageFull(Overloaded):
    """Redis is full (past its ``maxmemory``, with ``noeviction``): the call was refused
    before anything was written. Retry later; running jobs go on finishing (docs/
    deployment.md "A full Redis")."""


class ResultTimeout(PagedqError, TimeoutError):
    """The job did not reach a terminal state within the timeout."""


class EventsTrimmed(PagedqError):
    """The job's event log no longer holds the requested index (trimmed by its MAXLEN cap)
    while the job is still running; resume from a later index or wait for the result."""


class NoWorker(PagedqError):
    """``submit(..., require_worker=True)``: no live worker serves the job's model. Nothing
    was enqueued."""
