"""The gateway's Prometheus metrics, served unauthenticated on ``GET /metrics`` (as
``/health``): requests by route, method, status and tenant, their latency, the auth and
rate-limit rejections, the event streams open, and the process's CPU, RSS and open fds.

One registry per app (several apps may live in one test process). With ``--workers N``
each uvicorn process counts its own requests and a scrape reaches one of them: scrape each
gateway process (one per container or pod), or run one worker per process.

The tenant of a request is known only once its API key is admitted (gateway/auth.py), deep
in the handler: the middleware hands every request a dict through ``REQUEST`` (a context
variable; a dict, so that a handler run in a copied context still fills the same one).
"""
from __future__ import annotations

import time
from contextvars import ContextVar

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUEST: ContextVar[dict | None] = ContextVar("pagedq_gateway_request", default=None)
REJECTIONS = ("invalid_api_key", "missing_api_key", "rate_limited")
NO_ROUTE = "unmatched"  # a path no route serves (404): one label value, whatever the path
_LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = reg = CollectorRegistry()
        ProcessCollector(registry=reg)
        PlatformCollector(registry=reg)
        self.requests = Counter("pagedq:gateway_requests", "HTTP requests answered, by route "
                                "template, method, status and tenant (empty: not admitted)",
                                ["route", "method", "status", "tenant"], registry=reg)
        self.latency = Histogram("pagedq:gateway_request_duration_seconds",
                                 "Request to the end of its response (a stream's last event)",
                                 ["route"], buckets=_LAT, registry=reg)
        self.rejections = Counter("pagedq:gateway_rejections", "Requests refused at admission: "
                                  "no or an unknown API key (401), a rate limit (429)",
                                  ["reason"], registry=reg)
        self.streams = Gauge("pagedq:gateway_streams_open", "Server-sent event streams open",
                             registry=reg)
        for reason in REJECTIONS:
            self.rejections.labels(reason)

    def admitted(self, tenant: str) -> None:
        """The request's tenant, for its requests_total series."""
        info = REQUEST.get()
        if info is not None:
            info["tenant"] = tenant

    def rejected(self, reason: str) -> None:
        self.rejections.labels(reason).inc()

    def response(self) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


class Measure:
    """ASGI middleware: counts and times every HTTP request, and the streams open."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app, self.m = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        info: dict = {"status": 500}
        token = REQUEST.set(info)
        t0 = time.perf_counter()

        async def measured(message: Message) -> None:
            if message["type"] == "http.response.start":
                info["status"] = message["status"]
                ctype = dict(message.get("headers", ())).get(b"content-type", b"")
                if ctype.startswith(b"text/event-stream"):
                    info["stream"] = True
                    self.m.streams.inc()
            await send(message)
        try:
            await self.app(scope, receive, measured)
        finally:
            REQUEST.reset(token)
            if info.get("stream"):
                self.m.streams.dec()
            route = getattr(scope.get("route"), "path", NO_ROUTE)
            self.m.requests.labels(route, scope["method"], str(info["status"]),
                                   info.get("tenant", "")).inc()
            self.m.latency.labels(route).observe(time.perf_counter() - t0)
