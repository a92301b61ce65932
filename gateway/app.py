"""The FastAPI application: OpenAI's routes over pagedq (docs/gateway.md).

``create_app()`` builds it from the environment (PAGEDQ_*, PAGEDQ_GATEWAY_*, PAGEDQ_BATCH_*),
which is how ``pagedq gateway`` hands its options to every uvicorn worker process. Each
request is admitted (API key -> tenant, rate limits: gateway/auth.py), then served with its
tenant's AsyncClient or AsyncBatches (gateway/tenants.py).
"""
from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedq.batch import BatchSettings
from pagedq.wire.connection import connect_async, start_async_cluster
from pagedq.wire.errors import PagedqError
from pagedq.wire.redis_errors import RedisUnusable
from pagedq.wire.settings import Settings

from . import batches, completions, models, responses
from .auth import Auth
from .errors import APIError, from_pagedq
from .metrics import GatewayMetrics, Measure
from .requests import parse_json
from .settings import GatewaySettings
from .tenants import Tenants

log = logging.getLogger("pagedq.gateway")
REQUEST_ID = "x-request-id"


class Gateway:
    """What every request shares: settings, the admission check, the tenants' clients."""

    def __init__(self, settings: Settings, gateway: GatewaySettings,
                 batch_settings: BatchSettings) -> None:
        self.settings, self.gateway, self.batch_settings = settings, gateway, batch_settings
        self.redis = connect_async(settings, decode_responses=True)
        self.metrics = GatewayMetrics()
        self.auth = Auth(self.redis, settings.prefix, gateway.auth, gateway.keys_file,
                         self.metrics)
        self.tenants = Tenants(settings, batch_settings)

    async def aclose(self) -> None:
        await self.tenants.aclose()
        await self.redis.aclose()


def create_app(settings: Settings | None = None, gateway: GatewaySettings | None = None,
               batch_settings: BatchSettings | None = None) -> FastAPI:
    gw = Gateway(settings or Settings(), gateway or GatewaySettings(),
                 batch_settings or BatchSettings())
    if not log.handlers:  # one line per event on stderr, as uvicorn's own
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     pagedq.gateway %(message)s"))
        log.addHandler(handler)
        log.setLevel(gw.gateway.log_level.upper())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if gw.settings.redis_cluster:  # before any request: a lazy start raced by many fails
            try:
                await start_async_cluster(gw.redis, gw.settings.redis_url)
            except (redis.RedisError, RedisUnusable) as e:  # a request will retry the start
                log.warning("redis_cluster_not_started %s", e)
        yield
        await gw.aclose()

    app = FastAPI(title="pagedq gateway", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.gateway = gw

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> Response:
        return JSONResponse(e.body(), e.status, headers=e.headers())

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        msg = str(e.detail)
        if e.status_code in (404, 405) and msg in ("Not Found", "Method Not Allowed"):
            msg = (f"no route {request.method} {request.url.path}; the routes are: "
                   + ", ".join(routes(app)))
        return JSONResponse(APIError(e.status_code, msg, code).body(), e.status_code)

    @app.exception_handler(RequestValidationError)
    async def _bad_parameter(request: Request, e: RequestValidationError) -> Response:
        err = e.errors()[0] if e.errors() else {}
        loc = ".".join(str(x) for x in err.get("loc", ())[1:]) or None
        body = APIError(400, f"{loc}: {err.get('msg', 'invalid')}", "invalid_request", loc)
        return JSONResponse(body.body(), 400)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> Response:
        err = from_pagedq(e) if isinstance(e, redis.RedisError | PagedqError) else None
        if err is None:
            log.exception("unexpected_error path=%s", request.url.path)
            err = APIError(500, "internal error of the gateway", "internal_error")
        # (sent outside the request-id middleware: the id it made is in the scope)
        return JSONResponse(err.body(), err.status, headers={
            **err.headers(), REQUEST_ID: request.scope.get(REQUEST_ID, new_request_id())})

    async def tenant(request: Request) -> str:
        return (await gw.auth.admit(request.headers.get("authorization"), 0)).tenant

    @app.get("/health")
    async def health() -> Response:
        """Unauthenticated: 200 while Redis answers (for load balancers)."""
        try:
            await gw.redis.ping()
        except redis.RedisError:
            return JSONResponse({"status": "redis unavailable"}, 503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        """Unauthenticated, as /health: Prometheus's scrape (gateway/metrics.py)."""
        return gw.metrics.response()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await completions.handle(gw, "chat", request)

    @app.post("/v1/completions")
    async def completion(request: Request) -> Response:
        return await completions.handle(gw, "completion", request)

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        return await responses.handle(gw, request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, request: Request) -> Response:
        return await responses.retrieve(gw, await tenant(request), response_id)

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        served = await models.served(gw.tenants.client(await tenant(request)))
        return JSONResponse({"object": "list", "data": [models.model_object(m, i)
                                                        for m, i in served.items()]})

    @app.get("/v1/models/{model}")
    async def model(model: str, request: Request) -> Response:
        served = await models.served(gw.tenants.client(await tenant(request)), model)
        if model not in served:
            raise models.not_found(model)
        return JSONResponse(models.model_object(model, served[model]))

    @app.post("/v1/files")
    async def upload(request: Request) -> Response:
        return JSONResponse(await batches.upload(gw, await tenant(request), request))

    @app.get("/v1/files")
    async def list_files(request: Request, limit: int = 100) -> Response:
        return JSONResponse(await batches.list_files(gw, await tenant(request), limit))

    @app.get("/v1/files/{file_id}")
    async def retrieve_file(file_id: str, request: Request) -> Response:
        return JSONResponse(await batches.retrieve_file(gw, await tenant(request), file_id))

    @app.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str, request: Request) -> Response:
        return await batches.file_content(gw, await tenant(request), file_id)

    @app.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str, request: Request) -> Response:
        return JSONResponse(await batches.delete_file(gw, await tenant(request), file_id))

    @app.post("/v1/batches")
    async def create_batch(request: Request) -> Response:
        t = await tenant(request)
        return JSONResponse(await batches.create_batch(
            gw, t, parse_json(await completions.read_body(request, 1024 * 1024))))

    @app.get("/v1/batches")
    async def list_batches(request: Request, limit: int = 20) -> Response:
        return JSONResponse(await batches.list_batches(gw, await tenant(request), limit))

    @app.get("/v1/batches/{batch_id}")
    async def retrieve_batch(batch_id: str, request: Request) -> Response:
        return JSONResponse(await batches.retrieve_batch(gw, await tenant(request), batch_id))

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str, request: Request) -> Response:
        return JSONResponse(await batches.cancel_batch(gw, await tenant(request), batch_id))

    app.add_middleware(Measure, metrics=gw.metrics)
    app.add_middleware(RequestId)
    return app


def routes(app: FastAPI) -> list[str]:
    """``METHOD /path`` of every route, for the 404 of an unknown one."""
    return [f"{m} {r.path}" for r in app.routes if isinstance(r, APIRoute)
            for m in sorted(r.methods)]


def new_request_id() -> str:
    return "req_" + uuid.uuid4().hex


class RequestId:
    """Every response carries ``x-request-id`` (OpenAI's header), a new id per request,
    also in the scope (the handler of unexpected errors answers outside this)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = scope[REQUEST_ID] = new_request_id()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()),
                                                   (REQUEST_ID.encode(), rid.encode())]}
            await send(message)
        await self.app(scope, receive, send_with_id)
