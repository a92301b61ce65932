"""asyncio producer client (redis.asyncio): the same API and semantics as
producer.client.Client, with coroutines and async iterators. The protocol logic lives in
producer/client.py's helpers and producer/scripts.py; this file only does the I/O."""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import redis.asyncio as aredis

from .client import (
    POLL_S,
    READ_COUNT,
    RETRYABLE,
    SOCKET_TIMEOUT_S,
    Backoff,
    Cursor,
    block_ms,
    entries_of,
    final_of,
    remaining,
    trimmed_error,
)
from .errors import JobNotFound, ResultTimeout
from .keys import Keys, check_name
from .schema import TERMINAL, Event, FinalEvent, JobRecord, JobRequest, TokenEvent, parse_event
from .scripts import (
    build_request,
    cancel_call,
    check_cancel_reply,
    check_submit_reply,
    checked_id,
    collect_replies,
    register,
    served_call,
    served_reply,
    submit_call,
    with_id,
)
from .settings import Settings

T = TypeVar("T")


class AsyncClient:
    """``AsyncClient(redis_url=None, *, prefix=None, model=None, settings=None)``.
    Use ``async with`` or ``await client.aclose()``. Safe to share between tasks of one
    event loop."""

    def __init__(self, redis_url: str | None = None, *, prefix: str | None = None,
                 model: str | None = None, settings: Settings | None = None) -> None:
        self.settings = settings or Settings()
        self.keys = Keys(prefix or self.settings.prefix)
        self.model = check_name("model", model or self.settings.model)
        self.redis = aredis.Redis(connection_pool=aredis.BlockingConnectionPool.from_url(
            redis_url or self.settings.redis_url, decode_responses=True, timeout=None,
            max_connections=self.settings.client_max_connections,
            socket_timeout=SOCKET_TIMEOUT_S))
        self._scripts = register(self.redis)

    async def _retry(self, call: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        """``await call(*args, **kwargs)``, repeated on connection-level failures; the
        policy is producer.client.Backoff, as for Client."""
        backoff = Backoff(self.settings.client_retry_s)
        while True:
            try:
                return await call(*args, **kwargs)
            except RETRYABLE:
                delay = backoff.next_delay()
                if delay is None:
                    raise
                await asyncio.sleep(delay)

    # -- submit
    async def submit(self, prompt: str | list[int] | None = None, *, messages: list[Any] | None = None,
                     model: str | None = None, max_tokens: int | None = None,
                     temperature: float | None = None, top_p: float | None = None,
                     top_k: int | None = None, seed: int | None = None,
                     stop: list[str] | str | None = None, timeout_s: float | None = None,
                     job_id: str | None = None, require_worker: bool = False,
                     **params: Any) -> str:
        explicit = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                        top_k=top_k, seed=seed, stop=stop, timeout_s=timeout_s)
        req = build_request(prompt, messages, model or self.model, job_id, explicit, params)
        return await self._submit(req, require_worker)

    async def submit_request(self, req: JobRequest | dict[str, Any],
                       require_worker: bool = False) -> str:
        return await self._submit(with_id(req, self.model), require_worker)

    async def _submit(self, req: JobRequest, require_worker: bool = False) -> str:
        keys, args = submit_call(self.keys, req, self.settings, require_worker)
        return check_submit_reply(await self._retry(self._scripts.submit, keys, args), req.id)

    async def submit_many(self, reqs: list[JobRequest | dict[str, Any]]) -> list[str]:
        """See Client.submit_many."""
        reqs = [with_id(r, self.model) for r in reqs]
        calls = [submit_call(self.keys, req, self.settings) for req in reqs]

        async def send() -> list[Any]:
            async with self.redis.pipeline(transaction=False) as pipe:
                for keys, args in calls:
                    await self._scripts.submit(keys, args, client=pipe)
                return await pipe.execute(raise_on_error=False)
        return collect_replies(reqs, await self._retry(send))

    async def served_models(self) -> dict[str, int]:
        """Models with at least one live worker -> how many (from the workers'
        heartbeats, judged by Redis's clock)."""
        keys, args = served_call(self.keys)
        return served_reply(await self._retry(self._scripts.served, keys, args))

    # -- read
    async def status(self, job_id: str) -> JobRecord:
        job = self.keys.job(checked_id(job_id))
        h = await self._retry(self.redis.hgetall, job)
        if not h:
            raise JobNotFound(job_id)
        return JobRecord.from_hash(job_id, h)

    async def result(self, job_id: str, timeout: float | None = None) -> JobRecord:
        job, out = self.keys.job(checked_id(job_id)), self.keys.out(job_id)
        start = time.monotonic()

        async def head() -> list[Any]:
            async with self.redis.pipeline(transaction=True) as p:
                p.hgetall(job).xrevrange(out, "+", "-", count=1)
                return await p.execute()
        while True:
            h, last = await self._retry(head)
            if not h:
                raise JobNotFound(job_id)
            if h.get("status") in TERMINAL:
                return JobRecord.from_hash(job_id, h)
            last_id = last[0][0] if last else "0-0"
            while True:
                wait = remaining(timeout, start)
                if wait <= 0:
                    raise ResultTimeout(f"job {job_id!r} not done after {timeout} s")
                got = entries_of(await self._retry(self.redis.xread, {out: last_id},
                                                   count=READ_COUNT, block=block_ms(wait)))
                if not got or any(f.get("t") == "final" for _, f in got):
                    break
                last_id = got[-1][0]

    async def stream(self, job_id: str, from_index: int = 0,
                     timeout: float | None = None) -> AsyncIterator[Event]:
        """``async for ev in client.stream(id)``; see Client.stream."""
        job, out = self.keys.job(checked_id(job_id)), self.keys.out(job_id)
        cur = Cursor(from_index)
        if not await self._retry(self.redis.exists, job):
            raise JobNotFound(job_id)
        quiet_since, block, terminal_seen = time.monotonic(), None, False
        while True:
            got = entries_of(await self._retry(self.redis.xread, {out: cur.xid},
                                               count=READ_COUNT, block=block))
            if got:
                events, gap = cur.take(got)
                for ev in events:
                    yield ev
                    if isinstance(ev, FinalEvent):
                        return
                quiet_since = time.monotonic()
                if not gap:
                    continue
            h = await self._retry(self.redis.hgetall, job)
            if not h:
                raise JobNotFound(job_id)
            if h.get("status") in TERMINAL:
                if got or terminal_seen:
                    last = await self._retry(self.redis.xrevrange, out, "+", "-", count=1)
                    fin = final_of(job_id, h, last, cur)
                    if fin is not None:
                        yield fin
                    return
                terminal_seen, block = True, None
                continue
            if got:
                raise trimmed_error(job_id, cur.idx)
            wait = remaining(timeout, quiet_since)
            if wait <= 0:
                raise ResultTimeout(f"no event of job {job_id!r} for {timeout} s")
            block = block_ms(wait)

    async def stream_text(self, job_id: str, timeout: float | None = None) -> AsyncIterator[str]:
        sent = 0
        async for ev in self.stream(job_id, 0, timeout):
            if isinstance(ev, TokenEvent):
                if ev.delta:
                    sent += len(ev.delta)
                    yield ev.delta
            elif len(ev.text) > sent:
                yield ev.text[sent:]

    async def subscribe(self, job_id: str, timeout: float | None = None) -> AsyncIterator[Event]:
        """Pub/sub mirror, at-most-once; see Client.subscribe."""
        chan = self.keys.chan(checked_id(job_id))
        job, out = self.keys.job(job_id), self.keys.out(job_id)
        ps = self.redis.pubsub(ignore_subscribe_messages=True)
        try:
            await self._retry(ps.subscribe, chan)
            h = await self._retry(self.redis.hgetall, job)
            if h.get("status") in TERMINAL:
                last = await self._retry(self.redis.xrevrange, out, "+", "-", count=1)
                yield final_of(job_id, h, last, Cursor(0))  # type: ignore[misc]
                return
            quiet_since = time.monotonic()
            while True:
                wait = remaining(timeout, quiet_since)
                if wait <= 0:
                    raise ResultTimeout(f"no message for job {job_id!r} for {timeout} s")
                msg = await self._retry(ps.get_message, ignore_subscribe_messages=True,
                                        timeout=min(POLL_S, wait))
                if msg is None or msg.get("type") != "message":
                    continue
                ev = parse_event(json.loads(msg["data"]))
                quiet_since = time.monotonic()
                yield ev
                if isinstance(ev, FinalEvent):
                    return
        finally:
            await ps.aclose()

    # -- cancel
    async def cancel(self, job_id: str) -> bool:
        keys, args = cancel_call(self.keys, checked_id(job_id), self.settings)
        return check_cancel_reply(await self._retry(self._scripts.cancel, keys, args), job_id)

    # -- lifecycle
    async def aclose(self) -> None:
        await self.redis.aclose()

    close = aclose

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
