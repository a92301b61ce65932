"""The connection rq runs on (batch/runtime.py's queues, the batch worker and, through its
connection class, rq's scheduler process): rq's Lua scripts run as functions of pagedq's
``pagedq_rq`` library (pagedq.wire.lua.rq_scripts) on Redis >= 7, so that the batch and
gateway users need neither EVAL, EVALSHA nor SCRIPT (docs/security.md). On Redis 6.2 (no
functions, no ACL users) and for a script text the library does not hold, redis-py's
ordinary Script (EVALSHA) runs it.
"""
from __future__ import annotations

from typing import Any

import redis
from redis.commands.core import Script

from pagedq.wire import script
from pagedq.wire.connection import connect
from pagedq.wire.lua import rq_scripts
from pagedq.wire.settings import Settings


class _Function:
    """What ``register_script`` returns: called as redis-py's Script is (``keys``, ``args``,
    ``client``: a pipeline queues the call)."""

    def __init__(self, registered_client: redis.Redis, text: str | bytes) -> None:
        self.registered_client = registered_client
        self.script = text
        name = rq_scripts.function_name(text)
        self.function = name if name in rq_scripts.texts() else None
        self._script = Script(registered_client, text)

    def __call__(self, keys: list | None = None, args: list | None = None,
                 client: Any = None) -> Any:
        keys, args = list(keys or []), list(args or [])
        client = client if client is not None else self.registered_client
        if self.function is None or not script.prepare(self.registered_client):
            return self._script(keys, args, client)
        try:
            return client.fcall(self.function, len(keys), *keys, *args)
        except redis.ResponseError as e:
            if not script.missing(e):
                raise
            script.load_library(self.registered_client)  # LibraryMissing: may not
            return client.fcall(self.function, len(keys), *keys, *args)


class RqRedis(redis.Redis):
    """A redis.Redis whose ``register_script`` runs rq's scripts as functions."""

    def register_script(self, script: str | bytes) -> _Function:  # type: ignore[override]
        return _Function(self, script)


def connect_rq(settings: Settings, url: str) -> RqRedis:
    """rq's connection to ``url`` (never a cluster: rq cannot use one), with the settings'
    credentials and TLS."""
    r = connect(settings, url, cluster=False)
    return RqRedis(connection_pool=r.connection_pool)
