"""POST /v1/responses and GET /v1/responses/{id}: OpenAI's Responses API over one job
(the body's mapping and the response object: gateway/responses_api.py).

The request goes the way of a chat completion (gateway/completions.py: admission, a job
submitted only while a worker serves the model, detach, a client that goes away cancels
its job); ``stream: true`` answers the Responses event sequence (``ResponseEvents``). A
response is stored unless ``store: false``: the request's chat and what the response
repeats of it go into its job's record (field ``resp``), so ``GET /v1/responses/{id}`` and
a later ``previous_response_id`` read it back for as long as the record lives
(``PAGEDQ_RESULT_TTL_S`` after the job ends). The response id is ``resp_<job id>``.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anyio
import redis
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedq.producer.aio import AsyncClient
from pagedq.wire.errors import PagedqError
from pagedq.wire.keys import JOB_ID_RE, new_job_id
from pagedq.wire.openai_api import CallStream, token_logprobs
from pagedq.wire.openai_fields import FieldError
from pagedq.wire.schema import FinalEvent, JobRecord, Status, TokenEvent

from . import responses_api as R
from .completions import (
    SSE_HEADERS,
    EventStream,
    Gone,
    _created,
    _http,
    after,
    read_body,
    submit,
    wait_records,
)
from .errors import APIError, bad_request, not_found
from .requests import Generation, extension, job_request, parse_json

OWN = ("model", "stream", "store", "stream_options")  # taken out before the mapping


async def handle(gw: Any, request: Request) -> Response:
    raw = await read_body(request)
    problem: APIError | None = None
    body: dict[str, Any] = {}
    try:
        body = {k: v for k, v in parse_json(raw).items() if v is not None}
    except APIError as e:
        problem = e  # answered after the key is checked: a stranger learns nothing
    # what it may cost (as completions estimate): input characters / 4 + max_output_tokens
    most = body.get("max_output_tokens")
    est = len(json.dumps(body.get("input", ""))) // 4 + (most if isinstance(most, int) else 128)
    adm = await gw.auth.admit(request.headers.get("authorization"), est)
    if problem is not None:
        raise problem
    client = gw.tenants.client(adm.tenant)
    try:
        gen, echoed, chat, store = await _generation(gw, client, body, request.headers)
        await submit(gw, client, gen.reqs)
    except (PagedqError, redis.RedisError) as e:
        await gw.auth.settle(adm, -est)
        raise _http(gw, e) from None
    except APIError:
        await gw.auth.settle(adm, -est)  # nothing was queued: give the estimate back
        raise
    req = gen.req
    if store:
        await client.redis.hset(client.keys_of(gen.job_id).job(gen.job_id), "resp",
                                R.stored_json(echoed, chat, req.tools_active, req.model))
    if gen.stream:
        gone = Gone()
        events = ResponseEvents(gen.job_id, req.model, echoed, store, req.tools_active,
                                req.logprobs is not None)
        return EventStream(_stream(gw, client, gen, adm, est, gone, events), gone,
                           headers=SSE_HEADERS, media_type="text/event-stream")
    recs = await wait_records(gw, client, gen, adm, est, request)
    if recs is None:
        return Response(status_code=499)
    return JSONResponse(await _object(client, recs[0], echoed, store, req.tools_active,
                                      req.logprobs is not None))


async def _generation(gw: Any, client: AsyncClient, body: dict[str, Any],
                      headers: Any) -> tuple[Generation, dict[str, Any], list[Any], bool]:
    data = dict(body)
    model = data.pop("model", gw.settings.model)
    stream, store = data.pop("stream", False), data.pop("store", True)
    for name, v in (("stream", stream), ("store", store)):
        if not isinstance(v, bool):
            raise bad_request(f"{name} must be true or false", name)
    opts = data.pop("stream_options", {})
    if not isinstance(opts, dict) or set(opts) - {"include_obfuscation"}:
        raise bad_request("stream_options takes include_obfuscation", "stream_options")
    detach, job_id = extension(data, headers)
    history = None
    if (prev := data.get("previous_response_id")) is not None:
        history = await _history(client, prev)
    try:
        fields, echoed, chat = R.request_fields(data, history)
    except FieldError as e:
        raise bad_request(str(e), e.param) from None
    req = job_request(fields, job_id or new_job_id(gw.settings.partitions), model)
    gen = Generation("chat", (req,), stream, False, detach, None)
    return gen, echoed, chat, store


async def _history(client: AsyncClient, response_id: Any) -> list[dict[str, Any]]:
    """The chat a stored response leaves (its own and its output); 400 if there is none."""
    job = R.job_of(response_id) if isinstance(response_id, str) else None
    h = await client.redis.hgetall(client.keys_of(job).job(job)) if job and JOB_ID_RE.match(
        job) else {}
    if not h.get("resp"):
        raise bad_request(f"previous response {response_id!r} not found (never stored, "
                          "stored with store: false, or expired)", "previous_response_id")
    rec = JobRecord.from_hash(job, h)  # type: ignore[arg-type]
    if rec.status != Status.finished:
        raise bad_request(f"previous response {response_id!r} has not completed "
                          f"({rec.status})", "previous_response_id")
    return R.history_of(json.loads(h["resp"]), job, rec)  # type: ignore[arg-type]


async def retrieve(gw: Any, tenant: str, response_id: str) -> Response:
    client = gw.tenants.client(tenant)
    job = R.job_of(response_id)
    h = (await client.redis.hgetall(client.keys_of(job).job(job))
         if job and JOB_ID_RE.match(job) else {})
    if not h.get("resp"):
        raise not_found(f"no stored response {response_id!r}", "response_not_found")
    stored = json.loads(h["resp"])
    rec = JobRecord.from_hash(job, h)  # type: ignore[arg-type]
    logprobs = stored["echoed"].get("top_logprobs") is not None
    return JSONResponse(await _object(client, rec, stored["echoed"], True,
                                      stored["tools_active"], logprobs, stored["model"]))


async def _object(client: AsyncClient, rec: JobRecord, echoed: dict[str, Any], store: bool,
                  tools: bool, logprobs: bool, model: str | None = None) -> dict[str, Any]:
    status, incomplete, error = R.status_of(rec)
    output: list[dict[str, Any]] = []
    if rec.status in (Status.finished, Status.cancelled):
        lps = None
        if logprobs:
            log_ = await client.redis.xrange(client.keys_of(rec.id).out(rec.id))
            got = token_logprobs([f for _, f in log_], 1)
            lps = got[0] if got else None
        output = R.output_items(rec.id, rec, tools, lps)
    return R.response_object(rec.id, model or rec.model, int(rec.created_at or 0), echoed,
                             store, status, output, R.usage(rec) if rec.done else None,
                             incomplete, error)


# ---- streaming

class ResponseEvents:
    """The Responses API's events of one job's event log, in order: ``response.created``,
    ``response.in_progress``, then the output: a message (``output_item.added``,
    ``content_part.added``, an ``output_text.delta`` per token event, ``output_text.done``,
    ``content_part.done``, ``output_item.done``) or, when the job's tools are active and
    its output starts as calls, per call an ``output_item.added`` and
    ``function_call_arguments.delta`` events (``...done`` of each at the end); finally
    ``response.completed`` (``.incomplete``, ``.failed``) with the whole response."""

    def __init__(self, job_id: str, model: str, echoed: dict[str, Any], store: bool,
                 tools: bool, logprobs: bool) -> None:
        self.job_id, self.model, self.echoed, self.store = job_id, model, echoed, store
        self.tools, self.logprobs = tools, logprobs
        self.created = 0
        self.seq = 0
        self.calls: CallStream | None = None  # the output is calls (None: text, or unknown)
        self.started = False  # the message item was opened
        self.text = ""
        self.lps: list[dict[str, Any]] = []

    def frame(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()

    def head(self) -> bytes:
        r = R.response_object(self.job_id, self.model, self.created, self.echoed, self.store,
                              "in_progress", [], None)
        return self.frame("response.created", response=r) + self.frame(
            "response.in_progress", response=r)

    def token(self, ev: TokenEvent) -> bytes:
        out = b""
        lp = [t.model_dump() for t in ev.logprobs or []] if self.logprobs else []
        if self.tools and not self.started and self.calls is None and ev.delta.startswith("["):
            self.calls = CallStream(self.job_id, 0)
        if self.calls is not None:
            for d in self.calls.feed(ev.delta) or []:
                k = d["index"]
                if "id" in d:
                    out += self.frame("response.output_item.added", output_index=k,
                                      item=R.call_item(self.job_id, k, d["function"]["name"],
                                                       "", "in_progress"))
                if d["function"]["arguments"]:
                    out += self.frame("response.function_call_arguments.delta",
                                      item_id=f"fc_{self.job_id}_{k}", output_index=k,
                                      delta=d["function"]["arguments"])
            return out
        out += self._open()
        self.text += ev.delta
        self.lps += lp
        return out + self.frame("response.output_text.delta", item_id=f"msg_{self.job_id}",
                                output_index=0, content_index=0, delta=ev.delta,
                                logprobs=R.output_text("", lp)["logprobs"])

    def _open(self) -> bytes:
        if self.started:
            return b""
        self.started = True
        return self.frame("response.output_item.added", output_index=0,
                          item={**R.message_item(self.job_id, "", "in_progress"),
                                "content": []}) + self.frame(
            "response.content_part.added", item_id=f"msg_{self.job_id}", output_index=0,
            content_index=0, part=R.output_text(""))

    def final(self, rec: JobRecord) -> bytes:
        status, incomplete, error = R.status_of(rec)
        out = b""
        if self.calls is not None:
            for k, (name, args) in enumerate(self.calls.scanner.calls):
                item = R.call_item(self.job_id, k, name, args, "completed")
                out += self.frame("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=k, name=name, arguments=args)
                out += self.frame("response.output_item.done", output_index=k, item=item)
        elif status != "failed":
            out += self._open()
            part = R.output_text(self.text, self.lps)
            item_status = "completed" if status == "completed" else "incomplete"
            out += self.frame("response.output_text.done", item_id=f"msg_{self.job_id}",
                              output_index=0, content_index=0, text=self.text,
                              logprobs=part["logprobs"])
            out += self.frame("response.content_part.done", item_id=f"msg_{self.job_id}",
                              output_index=0, content_index=0, part=part)
            out += self.frame("response.output_item.done", output_index=0,
                              item=R.message_item(self.job_id, self.text, item_status,
                                                  self.lps))
        output = (R.output_items(self.job_id, rec, self.tools, self.lps)
                  if status != "failed" else [])
        r = R.response_object(self.job_id, self.model, self.created, self.echoed, self.store,
                              status, output, R.usage(rec), incomplete, error)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete",
                "cancelled": "response.incomplete"}.get(status, "response.failed")
        return out + self.frame(kind, response=r)


async def _stream(gw: Any, client: AsyncClient, gen: Generation, adm: Any, est: int,
                  gone: Gone, events: ResponseEvents) -> AsyncIterator[bytes]:
    final: FinalEvent | None = None
    try:
        events.created = await _created(client, gen.job_id)
        yield events.head()
        async for ev in client.stream(gen.job_id):
            if isinstance(ev, TokenEvent):
                if data := events.token(ev):
                    yield data
                continue
            final = ev
            rec = JobRecord(id=gen.job_id, status=ev.status, model=gen.req.model,
                            finish_reason=ev.finish_reason, text=ev.text, error=ev.error,
                            usage=ev.usage, created_at=events.created)
            yield events.final(rec)
    except (PagedqError, redis.RedisError) as e:
        err = _http(gw, e)
        yield events.frame("error", code=err.code, message=err.message, param=err.param)
    finally:
        with anyio.CancelScope(shield=True):
            await after(gw, client, gen, adm, est, {gen.job_id: final} if final else {},
                        gone.client)
