"""Synchronous producer client: submit, status, stream, result, cancel.

The reading protocol (status, result, stream, subscribe: cursor, trimmed log, terminal
re-read, timeouts) lives in producer/reader.py, sans I/O, shared with the asyncio client
(producer/aio.py); request building and reply checks in producer/scripts.py. This class is
the I/O shell: it makes the Redis calls those ask for and hands back the replies.

Riding out a Redis restart: every Redis call of both clients goes through a retry loop
(``Client._retry`` / ``AsyncClient._retry``) with one shared policy, ``Backoff``: a
connection-level failure is retried whole, with capped exponential backoff, for up to
``settings.client_retry_s`` seconds from its first failure, then re-raised. Each call is
safe to repeat: SUBMIT is idempotent by job id and request hash ('exists'), CANCEL is
idempotent, the rest are reads; a cut XREAD is re-sent from the same cursor, so stream()
neither loses nor repeats an event. The pools are built without redis-py's retry
options, so their connections do not retry on their own (``Retry(NoBackoff(), 0)``): this
is the only retry policy.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import redis

from . import reader, scripts
from .reader import RETRY_CAP_S, RETRY_FIRST_S, RETRYABLE, Backoff
from .schema import Event, JobRecord, JobRequest
from .settings import Settings

# the retry policy is re-exported from here, where it was first defined
__all__ = ["RETRYABLE", "RETRY_CAP_S", "RETRY_FIRST_S", "Backoff", "Client"]

T = TypeVar("T")


# ---------------------------------------------------------------- the client

class Client:
    """``Client(redis_url=None, *, prefix=None, model=None, settings=None)``; unset
    arguments come from ``Settings()`` (PAGEDQ_* environment). Thread-safe."""

    def __init__(self, redis_url: str | None = None, *, prefix: str | None = None,
                 model: str | None = None, settings: Settings | None = None) -> None:
        self.settings, self.keys, self.model, pool = reader.client_setup(
            redis_url, prefix, model, settings)
        self.redis = redis.Redis(connection_pool=redis.BlockingConnectionPool.from_url(**pool))
        self._scripts = scripts.register(self.redis)

    def _retry(self, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``call(*args, **kwargs)``, repeated on connection-level failures (see Backoff)."""
        backoff = Backoff(self.settings.client_retry_s)
        while True:
            try:
                return call(*args, **kwargs)
            except RETRYABLE as e:
                time.sleep(backoff.delay_after(e))

    def _drive(self, proto: reader.Protocol, ps: Any = None) -> Iterator[Any]:
        """Runs a reading protocol of producer/reader.py: makes each Redis command it asks
        for (through _retry, on ``ps`` for pub/sub ones) and sends back the reply; yields
        its events; returns what it returns."""
        run = reader.Exchange(proto)
        for step in run:
            if isinstance(step, reader.Command):
                run.reply = self._retry(step.call, self.redis, ps)
            else:
                yield step
        return run.value

    def _call(self, proto: reader.Protocol) -> Any:
        """A protocol without events (status, result): run it, return its value."""
        run = reader.Exchange(proto)
        for cmd in run:
            run.reply = self._retry(cmd.call, self.redis)
        return run.value

    # -- submit
    def submit(self, prompt: str | list[int] | None = None, *, messages: list[Any] | None = None,
               model: str | None = None, max_tokens: int | None = None,
               temperature: float | None = None, top_p: float | None = None,
               top_k: int | None = None, seed: int | None = None,
               stop: list[str] | str | None = None, timeout_s: float | None = None,
               job_id: str | None = None, require_worker: bool = False, **params: Any) -> str:
        """Validate and enqueue one job; returns its id. Idempotent per job id.
        ``require_worker``: refuse (NoWorker, nothing enqueued) unless a live worker serves
        the model."""
        explicit = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                        top_k=top_k, seed=seed, stop=stop, timeout_s=timeout_s)
        req = scripts.build_request(prompt, messages, model or self.model, job_id, explicit, params)
        return self._submit(req, require_worker)

    def submit_request(self, req: JobRequest | dict[str, Any],
                       require_worker: bool = False) -> str:
        return self._submit(scripts.with_id(req, self.model), require_worker)

    def _submit(self, req: JobRequest, require_worker: bool = False) -> str:
        keys, args = scripts.submit_call(self.keys, req, self.settings, require_worker)
        return scripts.check_submit_reply(self._retry(self._scripts.submit, keys, args), req.id)

    def submit_many(self, reqs: list[JobRequest | dict[str, Any]]) -> list[str]:
        """All requests are validated before anything is sent (InvalidRequest: nothing
        enqueued), then submitted in one pipeline, each atomically but not all together.
        On JobConflict/Overloaded the others are still enqueued; the first error is raised
        with ``.job_ids`` (None where refused). Resubmitting with fixed ids is safe."""
        reqs = [scripts.with_id(r, self.model) for r in reqs]
        calls = [scripts.submit_call(self.keys, req, self.settings) for req in reqs]

        def send() -> list[Any]:
            with self.redis.pipeline(transaction=False) as pipe:
                for keys, args in calls:
                    self._scripts.submit(keys, args, client=pipe)
                return pipe.execute(raise_on_error=False)
        return scripts.collect_replies(reqs, self._retry(send))

    def served_models(self) -> dict[str, int]:
        """Models with at least one live worker -> how many (from the workers'
        heartbeats, judged by Redis's clock)."""
        keys, args = scripts.served_call(self.keys)
        return scripts.served_reply(self._retry(self._scripts.served, keys, args))

    # -- read
    def status(self, job_id: str) -> JobRecord:
        return self._call(reader.read_status(self.keys, job_id))

    def result(self, job_id: str, timeout: float | None = None) -> JobRecord:
        """Wait until the job is terminal; wakes on every new event, never spins."""
        return self._call(reader.wait_result(self.keys, job_id, timeout))

    def stream(self, job_id: str, from_index: int = 0,
               timeout: float | None = None) -> Iterator[Event]:
        """Events from ``from_index`` in index order, each once, ending with the final
        event. ``timeout``: most seconds without a new event (ResultTimeout). Errors
        (JobNotFound, EventsTrimmed) are raised when iteration starts or reaches them."""
        yield from self._drive(reader.read_stream(self.keys, job_id, from_index, timeout))

    def stream_text(self, job_id: str, timeout: float | None = None) -> Iterator[str]:
        """Text deltas from the start; they concatenate to the final text."""
        return reader.text_deltas(self.stream(job_id, 0, timeout))

    def subscribe(self, job_id: str, timeout: float | None = None) -> Iterator[Event]:
        """Events from the pub/sub mirror: at-most-once, only those published after the
        subscription; the out stream (stream()) is the source of truth. After a lost
        connection redis-py resubscribes; what was published meanwhile is missed."""
        ps = self.redis.pubsub(ignore_subscribe_messages=True)
        try:
            yield from self._drive(reader.read_mirror(self.keys, job_id, timeout), ps)
        finally:
            ps.close()

    # -- cancel
    def cancel(self, job_id: str) -> bool:
        """True if cancelled (queued) or a cancel was requested (running); False if the
        job had already ended."""
        keys, args = scripts.cancel_call(self.keys, scripts.checked_id(job_id), self.settings)
        return scripts.check_cancel_reply(self._retry(self._scripts.cancel, keys, args), job_id)

    # -- lifecycle
    def close(self) -> None:
        self.redis.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

