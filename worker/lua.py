"""Running the worker's server-side scripts. Each runs atomically; each write to a job is
fenced by its ``attempt`` (a reclaiming worker bumps it, so a stale owner's writes are
refused). The scripts themselves are wire/lua/*.lua, behind pagedq.wire.lua.source.
"""
from __future__ import annotations

import hashlib

import redis

from pagedq.wire.connection import RETRYABLE, is_cluster
from pagedq.wire.lua import sharded, source


class Script:
    """One of the scripts below, run by EVALSHA. With ``client=pipeline`` it only queues
    the EVALSHA: redis-py's own Script objects make every pipeline.execute() send SCRIPT
    EXISTS first, one extra round trip per execute. A NOSCRIPT reply in a pipeline (Redis
    restarted or flushed its script cache) is the caller's to handle: ``load_all`` and
    send again (``noscript``). Every script here is fenced or idempotent, so a resend is
    safe. Called directly, it loads and retries by itself. On a cluster client it runs
    the script's sharded text (pagedq.wire.lua.sharded)."""

    sources: set[str] = set()  # of every Script made: what load_all loads

    def __init__(self, r: redis.Redis, source: str) -> None:
        if is_cluster(r):
            source = sharded(source)
        self.r, self.source = r, source
        self.sha = hashlib.sha1(source.encode()).hexdigest()
        Script.sources.add(source)

    def __call__(self, keys=(), args=(), client=None):
        if client is not None:  # a plain EVALSHA: redis-py's cluster pipeline refuses evalsha()
            client.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)
            return None
        try:
            return self.r.evalsha(self.sha, len(keys), *keys, *args)
        except redis.exceptions.NoScriptError:
            self.r.script_load(self.source)
            return self.r.evalsha(self.sha, len(keys), *keys, *args)


def noscript(results: list) -> bool:
    """Did a pipeline (executed with raise_on_error=False) meet an unloaded script?"""
    return any(isinstance(x, redis.exceptions.NoScriptError) for x in results)


def load_all(r: redis.Redis) -> None:
    """Load every script in use into Redis's script cache (on a cluster: every master's;
    a replica promoted by a failover may lack them)."""
    if is_cluster(r):  # SCRIPT LOAD goes to every master, one command each
        for text in Script.sources:
            r.script_load(text)
        return
    pipe = r.pipeline(transaction=False)
    for text in Script.sources:
        pipe.script_load(text)
    pipe.execute()


def failed(results: list) -> Exception | None:
    """The first connection-level failure among a pipeline's replies (a cluster pipeline
    executed with raise_on_error=False returns them, where a plain one raises), or None."""
    return next((x for x in results if isinstance(x, RETRYABLE)), None)


# The worker's scripts (wire/lua/*.lua: KEYS, ARGV and replies in each file's header)
START = source("start")
PUBLISH = source("publish")
FINISH = source("finish")
REJECT = source("reject")
REFRESH = source("refresh")
EXPIRE_UNSERVED = source("expire_unserved")
