"""POST /v1/chat/completions and /v1/completions: submit a job, then stream its events as
SSE (gateway/stream.py) or wait for its result and answer OpenAI's response body.

A client that goes away (a closed stream, or a closed connection while a non-streaming
request waits) cancels its job, unless the request asked it to outlive the connection
(``pagedq.detach`` / ``X-Pagedq-Detach: 1``). Nothing about a job is kept in the process:
a stream resumed on any gateway process reads the same log (``Last-Event-ID``).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import anyio
import redis
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from pagedq.producer.aio import AsyncClient
from pagedq.wire.errors import NoWorker, PagedqError
from pagedq.wire.openai_api import response_body, token_logprobs
from pagedq.wire.schema import FinalEvent, JobRecord, Status

from .apikeys import Admitted
from .errors import APIError, from_pagedq
from .requests import Generation, check_vocabulary, generation, parse_json
from .stream import Renderer, final_error, frame, prime, sse

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
            if isinstance(gen.req.prompt, list) or gen.req.logit_bias:
                size = await client.redis.hget(client.keys.vocab, gen.req.model)
                check_vocabulary(gen.req, int(size) if size else None)
            await submit(gw, client, gen)
        else:
            await client.status(gen.job_id)  # 404 now rather than an error event later
    except (PagedqError, redis.RedisError) as e:
        raise _http(gw, e) from None
    except APIError:
        await gw.auth.settle(adm, -est)  # nothing was queued: give the estimate back
        raise
    if gen.stream:
        gone = Gone()
        return EventStream(events(gw, client, gen, adm, est, gone), gone, headers=SSE_HEADERS,
                           media_type="text/event-stream")
    return await complete(gw, client, gen, adm, est, request)


async def submit(gw: Any, client: AsyncClient, gen: Generation) -> None:
    """Submit the job, refused unless a live worker serves its model: 404 for a model no
    worker announced in the last hour, 503 for one whose workers are all gone."""
    model = gen.req.model
    try:
        await client.submit_request(gen.req, require_worker=True)
    except NoWorker:
        if await client.redis.exists(client.keys.serving(model)):
            raise APIError(503, f"no live worker serves the model {model!r} now; retry later",
                           "no_worker", retry_after=5) from None
        raise APIError(404, f"the model {model!r} does not exist: no worker serves it",
                       "model_not_found", "model") from None
    except (PagedqError, redis.RedisError) as e:
        raise _http(gw, e) from None


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


async def events(gw: Any, client: AsyncClient, gen: Generation, adm: Admitted,
                 est: int, gone: Gone) -> AsyncIterator[bytes]:
    job_id, final = gen.job_id, None
    # the job's submission time (``created``), read while the stream waits for event 0
    created = asyncio.ensure_future(_created(client, job_id))
    try:
        r = Renderer(gen.kind, job_id, gen.req.model, 0, gen.req.n, gen.include_usage,
                     gen.logprobs, gen.tools)
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
            await _after(gw, client, gen, adm, est, final, gone.client)


async def _created(client: AsyncClient, job_id: str) -> int:
    return int((await client.status(job_id)).created_at or 0)


async def _after(gw: Any, client: AsyncClient, gen: Generation, adm: Admitted, est: int,
                 final: FinalEvent | None, client_gone: bool) -> None:
    """A stream or a wait is over: cancel the job if the client left before its end (and
    did not detach it); correct the rate window by the actual usage."""
    try:
        if final is None and client_gone and not gen.detach:
            await client.cancel(gen.job_id)
            log.info("client_gone_job_cancelled job_id=%s key_id=%s", gen.job_id, adm.key_id)
        elif final is not None and est:
            await gw.auth.settle(adm, final.usage.prompt_tokens + final.usage.completion_tokens
                                 - est)
    except (PagedqError, redis.RedisError) as e:  # the client is gone: only log
        log.warning("after_request_failed job_id=%s error=%s", gen.job_id, type(e).__name__)


# ---- waiting for the result

async def complete(gw: Any, client: AsyncClient, gen: Generation, adm: Admitted, est: int,
                   request: Request) -> Response:
    job_id = gen.job_id
    result = asyncio.ensure_future(client.result(job_id))
    gone = asyncio.ensure_future(_disconnected(request))
    final: FinalEvent | None = None
    try:
        await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not result.done():
            return Response(status_code=499)  # nobody reads it: the client has gone
        try:
            rec: JobRecord = result.result()
        except (PagedqError, redis.RedisError) as e:
            raise _http(gw, e) from None
        final = FinalEvent(index=0, status=rec.status, finish_reason=rec.finish_reason,
                           text=rec.text, error=rec.error, usage=rec.usage, choices=rec.choices)
        return await _response(client, gen, rec, final)
    finally:
        client_gone = gone.done() and not gone.cancelled()
        for t in (result, gone):
            t.cancel()
        await _after(gw, client, gen, adm, est, final, client_gone)


async def _disconnected(request: Request) -> None:
    """Returns once the client has closed the connection (the body is already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _response(client: AsyncClient, gen: Generation, rec: JobRecord,
                    final: FinalEvent) -> Response:
    if rec.status not in (Status.finished, Status.cancelled):
        err = final_error(final)["error"]
        status = 503 if err["code"] == "no_worker" else 504 if err["code"] == "deadline" else 500
        raise APIError(status, err["message"], err["code"])
    if rec.choices:
        choices = [c.model_dump() for c in rec.choices]
    else:
        choices = [{"index": 0, "text": rec.text, "finish_reason": rec.finish_reason}]
    lps = None
    if gen.logprobs:
        log_ = await client.redis.xrange(client.keys_of(gen.job_id).out(gen.job_id))
        lps = token_logprobs([f for _, f in log_], gen.req.n)
    return JSONResponse(response_body(gen.kind, gen.job_id, gen.req.model,
                                      int(rec.created_at or 0), choices, lps,
                                      rec.usage.prompt_tokens, rec.usage.completion_tokens,
                                      gen.tools))
