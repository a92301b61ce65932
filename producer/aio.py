"""asyncio producer client (redis.asyncio): the same API and semantics as
pagedq.producer.client.Client, with coroutines and async iterators. The reading protocol lives
in producer/reader.py, the request logic in producer/requests.py and wire/scripts.py; this file
only does
the I/O (awaiting the commands they ask for)."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar, Unpack

from pagedq.wire import script, scripts
from pagedq.wire.connection import client_redis, diagnose_tls, is_cluster, start_async_cluster
from pagedq.wire.keys import Keys
from pagedq.wire.redis_errors import RETRYABLE, RedisUnusable, is_fatal, looks_cut_by_tls
from pagedq.wire.schema import Event, JobRecord, JobRequest
from pagedq.wire.settings import Settings

from . import reader, requests, submit_params
from .reader import Backoff
from .submit_params import SubmitOptions

T = TypeVar("T")


class AsyncClient:
    """``AsyncClient(redis_url=None, *, prefix=None, model=None, settings=None)``.
    Use ``async with`` or ``await client.aclose()``. Safe to share between tasks of one
    event loop."""

    def __init__(self, redis_url: str | None = None, *, prefix: str | None = None,
                 model: str | None = None, settings: Settings | None = None) -> None:
        self.settings, self.keys, self.model, pool = reader.client_setup(
            redis_url, prefix, model, settings)
        self._url = pool["url"]
        self.redis = client_redis(self.settings, pool, asyncio=True)
        # a cluster client is started (slot map, connections) by one task before any
        # command is sent: connection.start_async_cluster
        self._started = not is_cluster(self.redis)
        self._start_lock = asyncio.Lock()

    async def _start(self) -> None:
        async with self._start_lock:
            if not self._started:
                await start_async_cluster(self.redis, self._url)
                self._started = True

    def keys_of(self, job_id: str) -> Keys:
        """The keys of the partition holding ``job_id`` (``self.keys``: partition 0)."""
        return self.keys.of_job(requests.checked_id(job_id), self.settings.partitions)

    async def _retry(self, call: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        """``await call(*args, **kwargs)``, repeated on connection-level failures; the
        policy is pagedq.producer.client.Backoff, as for Client (RedisUnusable at once too)."""
        backoff, diagnosed = Backoff(self.settings.client_retry_s), False
        while True:
            try:
                if not self._started:
                    await self._start()
                return await call(*args, **kwargs)
            except RETRYABLE as e:
                if is_fatal(e):
                    raise RedisUnusable(self._url, e) from e
                if not diagnosed and looks_cut_by_tls(self._url, e):  # once per call
                    diagnosed = True
                    bad = await asyncio.to_thread(diagnose_tls, self.settings, self._url)
                    if bad is not None:
                        raise bad from e
                await asyncio.sleep(backoff.delay_after(e))

    async def _drive(self, proto: reader.Protocol, ps: Any = None) -> AsyncIterator[Event]:
        """Runs a reading protocol of producer/reader.py that yields events (see
        Client._drive), awaiting each Redis command it asks for."""
        run = reader.Exchange(proto)
        for step in run:
            if isinstance(step, reader.Command):
                run.reply = await self._retry(step.call, self.redis, ps)
            else:
                yield step

    async def _call(self, proto: reader.Protocol) -> Any:
        """A protocol without events (status, result): run it, return its value."""
        run = reader.Exchange(proto)
        for cmd in run:
            run.reply = await self._retry(cmd.call, self.redis)
        return run.value

    # -- submit
    async def submit(self, prompt: str | list[int] | None = None,
                     **options: Unpack[SubmitOptions]) -> str:
        """Validate and enqueue one generation job; returns its id. The parameters, their
        ranges and defaults are Client.submit's (each None = the wire default): prompt or
        messages; model, tools, tool_choice, parallel_tool_calls, max_tokens, temperature,
        top_p, top_k, min_p, repetition_penalty, presence_penalty, frequency_penalty, stop,
        stop_token_ids, seed, ignore_eos, min_tokens, logprobs, prompt_logprobs, n, guided,
        logit_bias, priority, lane, timeout_s, metadata, job_id, require_worker; OpenAI's
        max_completion_tokens, top_logprobs, user, response_format."""
        req, require_worker = submit_params.build(prompt, options, self.model,
                                                  self.settings.partitions)
        return await self._submit(req, require_worker)

    async def submit_request(self, req: JobRequest | dict[str, Any],
                       require_worker: bool = False) -> str:
        return await self._submit(requests.with_id(req, self.model, self.settings.partitions),
                                  require_worker)

    async def _submit(self, req: JobRequest, require_worker: bool = False) -> str:
        call = scripts.Submit(self.keys, req, self.settings, require_worker)
        return await self._retry(script.run_async, self.redis, call)

    async def submit_many(self, reqs: list[JobRequest | dict[str, Any]]) -> list[str]:
        """See Client.submit_many."""
        reqs = [requests.with_id(r, self.model, self.settings.partitions) for r in reqs]
        calls = [scripts.Submit(self.keys, req, self.settings) for req in reqs]
        return requests.collect_replies(await self._retry(script.pipelined_async, self.redis,
                                                          calls))

    async def served_models(self) -> dict[str, int]:
        """Models with at least one live worker -> how many (from the workers'
        heartbeats, judged by Redis's clock)."""
        return await self._retry(script.run_async, self.redis, scripts.Served(self.keys))

    # -- read
    async def status(self, job_id: str) -> JobRecord:
        return await self._call(reader.read_status(self.keys_of(job_id), job_id))

    async def result(self, job_id: str, timeout: float | None = None) -> JobRecord:
        return await self._call(reader.wait_result(self.keys_of(job_id), job_id, timeout))

    async def stream(self, job_id: str, from_index: int = 0,
                     timeout: float | None = None) -> AsyncIterator[Event]:
        """``async for ev in client.stream(id)``; see Client.stream."""
        proto = reader.read_stream(self.keys_of(job_id), job_id, from_index, timeout)
        async for ev in self._drive(proto):
            yield ev

    async def stream_text(self, job_id: str, timeout: float | None = None) -> AsyncIterator[str]:
        cut = reader.TextDeltas()
        async for ev in self.stream(job_id, 0, timeout):
            if new := cut(ev):
                yield new

    async def subscribe(self, job_id: str, timeout: float | None = None) -> AsyncIterator[Event]:
        """Pub/sub mirror, at-most-once; see Client.subscribe."""
        ps = self.redis.pubsub(ignore_subscribe_messages=True)
        try:
            async for ev in self._drive(reader.read_mirror(self.keys_of(job_id), job_id, timeout),
                                        ps):
                yield ev
        finally:
            await ps.aclose()

    # -- cancel
    async def cancel(self, job_id: str) -> bool:
        call = scripts.Cancel(self.keys, requests.checked_id(job_id), self.settings)
        return await self._retry(script.run_async, self.redis, call)

    # -- lifecycle
    async def aclose(self) -> None:
        await self.redis.aclose()

    close = aclose

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
