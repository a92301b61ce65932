"""The connection rq runs on (batch/runtime.py's queues, the batch worker and, through its
connection class, rq's scheduler process): rq's Lua scripts run as functions of pagedq's
``pagedq_rq`` library on Redis >= 7 (pagedq.wire.script.RqRedis), so that the batch and
gateway users need neither EVAL, EVALSHA nor SCRIPT (docs/security.md)."""
from __future__ import annotations

from pagedq.wire.connection import connect
from pagedq.wire.script import RqRedis
from pagedq.wire.settings import Settings


def connect_rq(settings: Settings, url: str) -> RqRedis:
    """rq's connection to ``url`` (never a cluster: rq cannot use one), with the settings'
    credentials and TLS."""
    return RqRedis(connection_pool=connect(settings, url, cluster=False).connection_pool)
