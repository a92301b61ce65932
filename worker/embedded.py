"""Use the Redis at the configured URL, or start an embedded redis-server when nothing
answers there (the demo on a fresh machine)."""
from __future__ import annotations

import redis

from worker.redis_server import RedisServer


def redis_answers(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=0.5,
                                         socket_timeout=1.0).ping())
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        return False


def ensure_redis(url: str) -> tuple[str, RedisServer | None]:
    """(url that answers, server we started or None). The embedded server listens on a
    free port of 127.0.0.1 (the configured port may belong to something else)."""
    if redis_answers(url):
        return url, None
    srv = RedisServer().start()
    return srv.url, srv
