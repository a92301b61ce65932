"""What the engine loop does when Redis fails it (a part of the worker, worker/service.py):
an outage, a full Redis, a Redis that lost its data. None of them ends the process, and
none leaves a thread dead while the process lives: the engine keeps stepping its jobs while
the intake side backs off, and every job it holds is kept.

* Redis away (refused, reset, timeout, LOADING; on a cluster a master failing over): the
  intake call is retried with capped backoff (``redis_unavailable``).
* Redis full (past ``maxmemory`` with ``noeviction``: it refuses writes that may grow its
  memory): a refused START leaves its entry pending (worker/admission.py ``Read.deferred``),
  intake backs off and then reads its own pending entries again; the publisher retries its
  results (worker/publisher.py). Each part reports through ``redis_full``: /healthz and
  /readyz say ``degraded`` (worker/health.py), ``pagedq:degraded`` is 1,
  ``pagedq:redis_oom_errors_total`` counts the refusals, and one ``redis_full`` line is
  logged when it starts, one ``redis_writes_resumed`` when it ends.
* Redis lost its data (a restart without AOF, FLUSHALL, a failover to an empty replica):
  a jobs stream or its consumer group is gone (NOGROUP, or MOVE had to make the stream),
  and on Redis >= 7 the function library too. Every stream and group is made again as at
  start-up, the library loaded again, one loud ``redis_lost_data`` line logged and
  ``pagedq:streams_recreated_total`` counted; the worker goes on serving new jobs. (The
  jobs it ran lost their records with the data: their writes are fenced off and dropped.)
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from pagedq.wire import redis_errors, script
from pagedq.wire.errors import StorageFull
from pagedq.wire.keys import GROUP
from pagedq.wire.redis_errors import RETRYABLE

_FULL = (StorageFull, redis.exceptions.OutOfMemoryError)
_LOST = ("NOGROUP", "no such key")  # a stream or group gone (XREADGROUP, XINFO, ...)


class RedisFaults:
    """``ident``: the worker's WorkerIdentity; ``health``, ``metrics``: the worker's;
    ``busy()``: whether the engine has work (an idle loop may sleep out a backoff)."""

    def __init__(self, ident: Any, health: Any, metrics: Any, log: Any,
                 busy: Callable[[], bool]) -> None:
        self.ident, self.r, self.s = ident, ident.r, ident.settings
        self.health, self.metrics, self.log, self.busy = health, metrics, log, busy
        self.retry_at = 0.0
        self.backoff = 0.1
        self.reread_own = False  # read this worker's own pending entries again
        self._made: list[str] = []  # streams MOVE had to make (any thread appends)
        self._lock = threading.Lock()  # health's transitions, from any thread

    # ---- start-up and recovery --------------------------------------------------------
    def start_check(self) -> None:
        """The function library (Redis >= 7) and every stream's group; RedisUnusable when
        Redis refuses this user (its ACL)."""
        try:
            self.ensure_library()
            self.ensure_groups()
        except script.LibraryMissing as e:
            raise redis_errors.RedisUnusable(self.s.redis_url, e.__cause__ or e) from e
        except redis.RedisError as e:  # RedisUnusable is not RETRYABLE: call() raises it
            if redis_errors.is_fatal(e):
                raise redis_errors.RedisUnusable(self.s.redis_url, e) from e
            raise

    def ensure_library(self) -> None:
        found = script.ensure_library(self.r)
        if found is not None:
            self.log.info("functions_loaded", replaced=found or None)

    def ensure_groups(self) -> None:
        for stream in self.ident.streams:
            try:
                self.r.xgroup_create(stream, GROUP, id="0", mkstream=True)
            except redis.ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise

    def stream_made(self, stream: str) -> None:
        """MOVE made ``stream`` again (intake's hook, from either intake thread)."""
        self._made.append(stream)

    def recover_if_lost(self, error: BaseException | None = None) -> bool:
        """After a call: if a stream or group was gone (``error``, or a stream MOVE made),
        make every one again, reload the library, say so loudly; True if it was."""
        made, self._made = self._made, []
        if error is None and not made:
            return False
        self.ensure_groups()
        self.ensure_library()
        self.metrics.streams_recreated.inc(max(1, len(made)))
        self.log.error("redis_lost_data", error=str(error) if error else None,
                       streams_made=made, hint="a jobs stream or its group was gone: Redis "
                       "lost its data (restarted without AOF, FLUSHALL, failed over to an "
                       "empty replica); every stream and group is made again and new jobs "
                       "are served; the jobs it held are lost with it")
        return True

    # ---- a full Redis -----------------------------------------------------------------
    def redis_full(self, part: str, why: str) -> None:
        """``part`` of the worker had writes refused for memory (``why``), or none ("")."""
        with self._lock:
            if why:
                self.metrics.redis_oom.inc()
                if self.health.degrade(part, f"Redis is full: it refuses the {part}'s "
                                             f"writes ({why.split('.', 1)[0]})"):
                    self.log.warning("redis_full", part=part, error=why)
            elif self.health.recover(part):
                self.log.info("redis_writes_resumed", part=part)
            self.metrics.degraded.set(1 if self.health.degraded else 0)

    # ---- the engine loop's Redis calls --------------------------------------------------
    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run an intake-side Redis operation; on an outage, a full Redis or lost data, back
        off (capped) and report False. The engine keeps stepping meanwhile."""
        if time.monotonic() < self.retry_at:
            if not self.busy():
                time.sleep(min(0.1, self.retry_at - time.monotonic()))
            return False
        try:
            try:
                out = fn(*args)
            except redis.ResponseError as e:
                if isinstance(e, _FULL) or not any(m in str(e) for m in _LOST):
                    raise
                self.recover_if_lost(e)
                return self._later(e, quiet=True)
            if self.recover_if_lost():
                self.reread_own = True
        except _FULL as e:
            self.redis_full("intake", str(e))
            return self._later(e, quiet=True)
        except RETRYABLE as e:
            return self._later(e)
        self.backoff = 0.1
        return True if out is None else out

    def _later(self, e: BaseException, quiet: bool = False) -> bool:
        """Retry after the backoff; entries this worker read and did not start meanwhile
        are read again then (its own pending ones)."""
        if not quiet:
            self.log.warning("redis_unavailable", error=str(e), retry_in_s=self.backoff)
        self.retry_at = time.monotonic() + self.backoff
        self.backoff = min(self.backoff * 2, 5.0)
        self.reread_own = True
        return False

    def after_poll(self, deferred: bool, wrote: bool) -> None:
        """Intake's poll ended; ``deferred``: Redis refused a START for memory in it;
        ``wrote``: it took a MOVE or a START (only that says intake writes again: a poll
        that wrote nothing proves nothing)."""
        if deferred:
            self.redis_full("intake", "a START was refused for memory")
            self._later(StorageFull("START refused"), quiet=True)
        elif wrote:
            self.redis_full("intake", "")
