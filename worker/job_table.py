"""The worker's table of owned jobs, and how a job leaves it (a part of the worker,
worker/service.py composes it; intake adds to it, worker/admission.py).

Owned by the engine thread: every change to the table happens there. The one reader
elsewhere is intake's reader thread, which only tests membership (worker/admission.py
``parse``), while the engine thread adds no job that read could hold.

Invariant: a job is in the table from the START that made this worker its owner until it
ends (``end``: its final result is handed to the publisher), is lost to a newer attempt or
dead-lettered (``drop``: no result from here), or is handed back (``clear``).
"""
from __future__ import annotations

import time
from collections.abc import Iterator

from pagedq.wire.schema import FinishReason, Status
from pagedq.wire.worker_scripts import Verdict
from pagedq.worker.jobs import Job, WorkerIdentity
from pagedq.worker.metrics import Metrics
from pagedq.worker.publisher import Final, Publisher


class JobTable:
    """The jobs this worker started and has not ended, by uid (worker/jobs.py Job.uid)."""

    def __init__(self, ident: WorkerIdentity, publisher: Publisher, metrics: Metrics,
                 log) -> None:
        self.ident, self.publisher, self.metrics, self.log = ident, publisher, metrics, log
        self._jobs: dict[str, Job] = {}

    def __len__(self) -> int:
        return len(self._jobs)

    def __iter__(self) -> Iterator[str]:
        """The uids (a copy is taken by ``list(table)``; the table may change after)."""
        return iter(self._jobs)

    def __contains__(self, uid: object) -> bool:
        return uid in self._jobs

    def get(self, uid: str) -> Job | None:
        return self._jobs.get(uid)

    def values(self) -> list[Job]:
        """A snapshot: callers may end jobs while they walk it."""
        return list(self._jobs.values())

    def add(self, job: Job) -> None:
        self._jobs[job.uid] = job

    def drop(self, uid: str) -> Job | None:
        """Forget a job without a result (lost to a newer attempt, dead-lettered)."""
        return self._jobs.pop(uid, None)

    def clear(self) -> None:
        self._jobs.clear()

    def end(self, job: Job, status: Status, reason: FinishReason, error: str = "") -> None:
        """End the job: choices still running end with ``reason`` (cancelled, deadline);
        its final result goes to the publisher."""
        self._jobs.pop(job.uid, None)
        for choice in job.choices:
            if choice.finish_reason is None:
                choice.finish_reason = reason
        jlog, m = self.log.bind(job_id=job.job_id, prefix=job.keys.prefix), self.metrics

        def done(verdict: Verdict | str) -> None:
            m.ended(job.keys.prefix, status, reason)
            m.e2e.observe(job.queue_wait_s + time.monotonic() - job.admitted_at)
            m.tokens_of(job.keys.prefix, job.prompt_tokens, job.completion_tokens)
            if job.first_token_at is not None and job.last_token_at is not None:
                m.prefill_time.observe(job.first_token_at - job.admitted_at)
                m.decode_time.observe(job.last_token_at - job.first_token_at)
            jlog.info("job_done", status=status, finish_reason=reason, verdict=verdict,
                      completion_tokens=job.completion_tokens)

        self.publisher.final(Final(job.keys, job.job_id, job.attempt, job.entry_id,
                                   self.ident.stream(job.lane, job.keys), status, reason,
                                   job.text, error, job.prompt_tokens,
                                   job.completion_tokens, done, job.choices_json()))
