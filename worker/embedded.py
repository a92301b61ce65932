"""Use the Redis at the configured URL, or start an embedded redis-server when nothing
answers there (the demo on a fresh machine)."""
from __future__ import annotations

from pagedq.wire.connection import probe
from pagedq.wire.settings import Settings
from pagedq.worker.redis_server import RedisServer


def redis_answers(url: str, settings: Settings | None = None) -> bool:
    """Whether a Redis answers at ``url`` (with the settings' credentials and TLS). One
    that answers but refuses them raises RedisUnusable: starting an embedded server in
    its place would hide the mistake."""
    return probe(settings or Settings(), url, timeout_s=1.0)


def ensure_redis(url: str, settings: Settings | None = None) -> tuple[str, RedisServer | None]:
    """(url that answers, server we started or None). The embedded server listens on a
    free port of 127.0.0.1 (the configured port may belong to something else)."""
    if redis_answers(url, settings):
        return url, None
    srv = RedisServer().start()
    return srv.url, srv
