"""POST /v1/chat/completions and /v1/completions: submit a job (completions: one per
prompt of a list), then stream its events as SSE (gateway/stream.py) or wait for its
result and answer OpenAI's response body.

A client that goes away (a closed stream, or a closed connection while a non-streaming
request waits) cancels its job, unless the request asked it to outlive the connection
(``pagedq.detach`` / ``X-Pagedq-Detach: 1``). Nothing about a job is kept in the process:
a stream resumed on any gateway process reads the same log (``Last-Event-ID``).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio
import redis
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from pagedq.producer.aio import AsyncClient
from pagedq.wire.errors import NoWorker, PagedqError
from pagedq.wire.openai_api import Echo, prompt_head, response_body, token_logprobs, usage
from pagedq.wire.schema import FinalEvent, JobRecord, JobRequest, Status

from . import models
from .apikeys import Admitted
from .errors import APIError, from_pagedq
from .requests import Generation, check_vocabulary, generation, parse_json
from .stream import Counter, Renderer, final_error, frame, prime, sse

log = logging.getLogger("pagedq.gateway")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# a request body: a JobRequest holds up to 1,000,000 characters of prompt (as JSON escapes,
# up to 6 bytes each) and some parameters
MAX_BODY_BYTES = 8 * 1024 * 1024


async def handle(gw: Any, kind: str, request: Request) -> Response:
    raw = await read_body(request)
    gen: Generation | None = None
    problem: APIError | None = None
    try:
        gen = generation(kind, parse_json(raw), gw.settings.model, request.headers,
                         gw.settings.partitions)
    except APIError as e:
        problem = e  # answered after the key is checked: a stranger learns nothing
    est = gen.est_tokens() if gen is not None and gen.resume is None else 0
    adm = await gw.auth.admit(request.headers.get("authorization"), est)
    if problem is not None or gen is None:
        raise problem  # type: ignore[misc]
    client = gw.tenants.client(adm.tenant)
    try:
        if gen.resume is None:
            if any(isinstance(r.prompt, list) or r.logit_bias for r in gen.reqs):
                size = await client.redis.hget(client.keys.vocab, gen.req.model)
                for r in gen.reqs:
                    check_vocabulary(r, int(size) if size else None)
            await submit(gw, client, gen.reqs)
        else:
            await client.status(gen.job_id)  # 404 now rather than an error event later
    except (PagedqError, redis.RedisError) as e:
        raise _http(gw, e) from None
    except APIError:
        await gw.auth.settle(adm, -est)  # nothing was queued: give the estimate back
        raise
    if gen.stream:
        gone = Gone()
        body = (events if len(gen.reqs) == 1 else merged)(gw, client, gen, adm, est, gone)
        return EventStream(body, gone, headers=SSE_HEADERS, media_type="text/event-stream")
    return await complete(gw, client, gen, adm, est, request)


async def submit(gw: Any, client: AsyncClient, reqs: Sequence[JobRequest]) -> None:
    """Submit the jobs, each refused unless a live worker serves its model (gateway/
    models.py: 503 for a model served recently, else 404). If one is refused, those
    queued before it are cancelled: a request makes all its jobs or none."""
    queued: list[str] = []
    try:
        for req in reqs:
            try:
                await client.submit_request(req, require_worker=True)
            except NoWorker:
                raise await models.unavailable(client, req.model) from None
            except (PagedqError, redis.RedisError) as e:
                raise _http(gw, e) from None
            queued.append(req.id)  # type: ignore[arg-type]
    except BaseException:
        with anyio.CancelScope(shield=True):
            for job_id in queued:
                with contextlib.suppress(PagedqError, redis.RedisError):
                    await client.cancel(job_id)
        raise


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The request body, refused (413) past ``limit`` bytes before it is all read."""
    size = request.headers.get("content-length", "")
    if size.isdigit() and int(size) > limit:
        raise APIError(413, f"the body is larger than {limit} bytes", "request_too_large")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise APIError(413, f"the body is larger than {limit} bytes", "request_too_large")
    return bytes(body)


def _http(gw: Any, e: Exception) -> APIError:
    return from_pagedq(e, gw.gateway.overloaded_retry_after_s) or APIError(500, str(e))


# ---- streaming

class Gone:
    """Set when the client closed its connection. A request cut because this process
    shuts down is not: its job goes on, and the client may resume it elsewhere."""

    __slots__ = ("client",)

    def __init__(self) -> None:
        self.client = False


class EventStream(StreamingResponse):
    """Starlette's streaming response, watching for the client's disconnect whatever the
    server's ASGI version (``gone``), and always closing the body iterator (its
    ``finally`` cancels the job when the client went away) once the stream is over."""

    def __init__(self, content: AsyncIterator[bytes], gone: Gone, **kw: Any) -> None:
        super().__init__(content, **kw)
        self.gone = gone

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as tg:
            async def pump() -> None:
                try:
                    await self.stream_response(send)
                except OSError:  # the client went away (servers of ASGI spec 2.4)
                    self.gone.client = True
                finally:
                    with anyio.CancelScope(shield=True):
                        await self.body_iterator.aclose()  # type: ignore[attr-defined]
                    tg.cancel_scope.cancel()

            tg.start_soon(pump)
            while (await receive())["type"] != "http.disconnect":
                pass
            self.gone.client = True
            tg.cancel_scope.cancel()


def renderer(gen: Generation, i: int = 0, **kw: Any) -> Renderer:
    """The renderer of job ``i`` of ``gen`` (gateway/stream.py)."""
    return Renderer(gen.kind, gen.job_ids[i], gen.req.model, 0, gen.req.n, gen.include_usage,
                    gen.logprobs, gen.tools, continuous=gen.continuous_usage, echo=gen.echo,
                    prompt=gen.texts[i] if gen.texts else None, **kw)


async def events(gw: Any, client: AsyncClient, gen: Generation, adm: Admitted,
                 est: int, gone: Gone) -> AsyncIterator[bytes]:
    job_id, final = gen.job_id, None
    # the job's submission time (``created``), read while the stream waits for event 0
    created = asyncio.ensure_future(_created(client, job_id))
    try:
        r = renderer(gen)
        start, skip = (gen.resume[1], gen.resume[2]) if gen.resume else (0, -1)
        await prime(client, r, start)
        async for data, fin in sse(client, r, start, skip, created):
            final = fin
            if data:
                yield data
    except (PagedqError, redis.RedisError) as e:
        err = _http(gw, e)
        yield frame(f"{job_id}/error", err.body())
    finally:
        if created.done() and not created.cancelled():
            created.exception()  # seen (the stream reported the same problem)
        created.cancel()
        with anyio.CancelScope(shield=True):
            await after(gw, client, gen, adm, est, {job_id: final} if final else {},
                        gone.client)


async def merged(gw: Any, client: AsyncClient, gen: Generation, adm: Admitted,
                 est: int, gone: Gone) -> AsyncIterator[bytes]:
    """The stream of a completions request of several prompts: its jobs' chunks as they
    come (each job's choices renumbered, gateway/stream.py), then one usage chunk and
    [DONE] once every job ended. Not resumable (each job's SSE ids name its own events).
    A job that fails ends the stream with its error (and cancels the others)."""
    counter, finals, failed = Counter(), {}, False
    created = asyncio.ensure_future(_created(client, gen.job_id))
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(r: Renderer) -> None:
        try:
            async for data, fin in sse(client, r, 0, -1, created):
                await queue.put((r.job_id, data, fin, None))
        except (PagedqError, redis.RedisError) as e:
            await queue.put((r.job_id, b"", None, e))
        finally:
            await queue.put((r.job_id, None, None, None))  # this job's stream is over

    rs = [renderer(gen, i, base=i * gen.req.n, name=gen.job_id, tail=False, counter=counter)
          for i in range(len(gen.reqs))]
    tasks = [asyncio.ensure_future(pump(r)) for r in rs]
    try:
        running = len(tasks)
        while running:
            job_id, data, fin, err = await queue.get()
            if data is None:
                running -= 1
            elif err is not None:
                failed = True
                yield frame(f"{job_id}/error", _http(gw, err).body())
                return
            else:
                yield data
                if fin is not None:
                    finals[job_id] = fin
                    if fin.status not in (Status.finished, Status.cancelled):
                        failed = True  # its error event was the last chunk
                        return
        yield b"".join(frame(f"{gen.job_id}/end.{j}", c) for j, c in enumerate(rs[0].end()))
    finally:
        for t in tasks:
            t.cancel()
        if created.done() and not created.cancelled():
            created.exception()
        created.cancel()
        with anyio.CancelScope(shield=True):
            await after(gw, client, gen, adm, est, finals, gone.client or failed)


async def _created(client: AsyncClient, job_id: str) -> int:
    return int((await client.status(job_id)).created_at or 0)


async def after(gw: Any, client: AsyncClient, gen: Generation, adm: Admitted, est: int,
                finals: dict[str, FinalEvent], cancel: bool) -> None:
    """A stream or a wait is over: ``cancel`` (the client left, or the response ended in
    an error) cancels the jobs that did not end, unless the request detached them; once
    all ended, the rate window is corrected by their actual usage."""
    left = [j for j in gen.job_ids if j not in finals]
    try:
        if left and cancel and not gen.detach:
            for job_id in left:
                await client.cancel(job_id)
            log.info("client_gone_job_cancelled job_id=%s key_id=%s", ",".join(left),
                     adm.key_id)
        elif not left and est:
            await gw.auth.settle(adm, sum(f.usage.prompt_tokens + f.usage.completion_tokens
                                          for f in finals.values()) - est)
    except (PagedqError, redis.RedisError) as e:  # the client is gone: only log
        log.warning("after_request_failed job_id=%s error=%s", gen.job_id, type(e).__name__)


# ---- waiting for the result

async def complete(gw: Any, client: AsyncClient, gen: Generation, adm: Admitted, est: int,
                   request: Request) -> Response:
    recs = await wait_records(gw, client, gen, adm, est, request)
    if recs is None:
        return Response(status_code=499)  # nobody reads it: the client has gone
    return await _response(client, gen, recs)


async def wait_records(gw: Any, client: AsyncClient, gen: Generation, adm: Admitted, est: int,
                       request: Request) -> list[JobRecord] | None:
    """The jobs' records once all ended (None if the client went away first: its jobs are
    cancelled unless detached); the rate window is corrected either way (``after``)."""
    result = asyncio.ensure_future(asyncio.gather(*(client.result(j) for j in gen.job_ids)))
    gone = asyncio.ensure_future(_disconnected(request))
    finals: dict[str, FinalEvent] = {}
    try:
        await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not result.done():
            return None
        try:
            recs: list[JobRecord] = result.result()
        except (PagedqError, redis.RedisError) as e:
            raise _http(gw, e) from None
        finals = {r.id: FinalEvent(index=0, status=r.status, finish_reason=r.finish_reason,
                                   text=r.text, error=r.error, usage=r.usage,
                                   choices=r.choices) for r in recs}
        return recs
    finally:
        client_gone = gone.done() and not gone.cancelled()
        for t in (result, gone):
            t.cancel()
        if result.done() and not result.cancelled():
            result.exception()  # seen (raised above, or none)
        await after(gw, client, gen, adm, est, finals, client_gone)


async def _disconnected(request: Request) -> None:
    """Returns once the client has closed the connection (the body is already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _response(client: AsyncClient, gen: Generation, recs: list[JobRecord]) -> Response:
    """The response body of the jobs' records: job i's choice c is choice i * n + c."""
    bodies = []
    for i, rec in enumerate(recs):
        if rec.status not in (Status.finished, Status.cancelled):
            err = final_error(FinalEvent(index=0, status=rec.status,
                                         finish_reason=rec.finish_reason, error=rec.error))
            err = err["error"]
            status = (503 if err["code"] == "no_worker" else 504 if err["code"] == "deadline"
                      else 500)
            raise APIError(status, err["message"], err["code"])
        choices = ([c.model_dump() for c in rec.choices] if rec.choices else
                   [{"index": 0, "text": rec.text, "finish_reason": rec.finish_reason}])
        lps, echo = None, None
        if gen.logprobs or gen.echo:
            log_ = [f for _, f in await client.redis.xrange(client.keys_of(rec.id).out(rec.id))]
            lps = token_logprobs(log_, gen.req.n) if gen.logprobs else None
            if gen.echo:
                echo = Echo.of(gen.texts[i], prompt_head(log_)[1], gen.logprobs)
        bodies.append(response_body(gen.kind, rec.id, gen.req.model, int(rec.created_at or 0),
                                    choices, lps, rec.usage.prompt_tokens,
                                    rec.usage.completion_tokens, gen.tools, echo))
    body = bodies[0]
    if len(bodies) > 1:
        for i, b in enumerate(bodies[1:], 1):
            for c in b["choices"]:
                c["index"] += i * gen.req.n
            body["choices"] += b["choices"]
        body["usage"] = usage(sum(b["usage"]["prompt_tokens"] for b in bodies),
                              sum(b["usage"]["completion_tokens"] for b in bodies))
    return JSONResponse(body)
