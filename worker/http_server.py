"""One small HTTP server per worker: Prometheus metrics and the health endpoints.

  GET /healthz   liveness  (worker/health.py): 200 or 503, a short JSON body either way
  GET /readyz    readiness (worker/health.py): as /healthz, and 503 while draining
  GET /metrics   Prometheus text format 0.0.4 (any other path too, as prometheus_client
                 does), whatever the Accept header asks: metric names keep their colons

prometheus_client's own start_http_server serves metrics only; this is its WSGI app behind
a threading wsgiref server, with the health paths in front. Each request runs in its own
daemon thread, so a slow scrape never delays a health probe, and nothing here waits on
the engine thread.
"""
from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterable
from http import HTTPStatus
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from pagedq.worker.health import Health

HEALTH_PATHS = {"/healthz": False, "/readyz": True}  # path -> readiness check?
TEXT_FORMAT = "text/plain; version=0.0.4"


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base's name
        """Every probe would be a stderr line otherwise (the worker logs JSON only)."""


def make_app(registry: CollectorRegistry, health: Health | None) -> Callable:
    metrics_app = make_wsgi_app(registry)

    def app(environ: dict, start_response: Callable) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path in HEALTH_PATHS:
            if health is None:
                code, body = 404, {"status": "unknown", "reason": "no health state here"}
            else:
                code, body = health.check(ready=HEALTH_PATHS[path])
            data = (json.dumps(body) + "\n").encode()
            start_response(f"{code} {HTTPStatus(code).phrase}",
                           [("Content-Type", "application/json"),
                            ("Content-Length", str(len(data))), ("Cache-Control", "no-store")])
            return [data]
        # always the Prometheus text format, never OpenMetrics: prometheus_client's
        # OpenMetrics output (what Prometheus 2.x asks for first) writes `pagedq:x` samples
        # as `pagedq_x` under a `pagedq:x` TYPE line, so dashboards would find nothing
        return metrics_app({**environ, "HTTP_ACCEPT": TEXT_FORMAT}, start_response)

    return app


def serve(registry: CollectorRegistry, health: Health | None, port: int,
          host: str = "127.0.0.1") -> WSGIServer:
    """Listen on ``host``:``port`` (port 0 = a free one: ``server.server_port``) in a daemon
    thread. An IPv6 ``host`` gets an IPv6 socket."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                   flags=socket.AI_PASSIVE)[0]

    class Server(_Server):
        address_family = family

    httpd = make_server(sockaddr[0], port, make_app(registry, health), Server,
                        handler_class=_QuietHandler)
    threading.Thread(target=httpd.serve_forever, name="pagedq-http", daemon=True).start()
    return httpd
