"""Taking over the jobs of dead or wedged workers.

An entry idle past the lease belongs to a worker that stopped refreshing it (its engine
loop died or wedged: leases are refreshed from that loop). XAUTOCLAIM moves it to us;
the START script bumps the job's attempt, which fences the old owner. An entry
delivered more than max_deliveries times is poison: dead-lettered, its job failed.
"""
from __future__ import annotations

from dataclasses import dataclass

import redis

from pagedq.wire import script, worker_scripts
from pagedq.wire.keys import GROUP


@dataclass(slots=True)
class Claimed:
    entry_id: str
    fields: dict[str, str] | None  # None: the entry was deleted from the stream
    deliveries: int


def reclaim(r: redis.Redis, stream: str, consumer: str, lease_s: float, count: int,
            cursor: str = "0-0") -> tuple[str, list[Claimed]]:
    """Claim up to ``count`` entries idle longer than the lease. Returns (next cursor,
    claimed entries with their delivery counts, including this delivery)."""
    if count <= 0:
        return cursor, []
    res = r.xautoclaim(stream, GROUP, consumer, min_idle_time=int(lease_s * 1000),
                       start_id=cursor, count=count)
    next_cursor, entries = res[0], res[1]
    deleted = res[2] if len(res) > 2 else []
    if not entries and not deleted:
        return next_cursor, []
    pipe = r.pipeline(transaction=False)
    for entry_id, _f in entries:
        pipe.xpending_range(stream, GROUP, min=entry_id, max=entry_id, count=1)
    counts = pipe.execute()
    out = []
    for (entry_id, fields), pend in zip(entries, counts, strict=True):
        n = pend[0]["times_delivered"] if pend else 1
        out.append(Claimed(entry_id, fields, n))
    for entry_id in deleted:
        out.append(Claimed(entry_id, None, 0))
    return next_cursor, out



class UnservedSweep:
    """Expires queued jobs of models that no live worker serves. Every worker runs it for
    every model in ``{P}:models`` of every tenant it serves, its own model included: a
    lone worker that stopped serving its model leaves no one else to do it."""

    def __init__(self, ident, log) -> None:
        self.ident, self.log = ident, log

    def run(self) -> None:
        r, s = self.ident.r, self.ident.settings
        pipe = r.pipeline(transaction=False)
        for keys in self.ident.tenants:
            pipe.smembers(keys.models)
        # every lane this worker knows of (a lane only a producer knows waits for a worker
        # that has it in its settings.lanes)
        targets = [(keys, m, lane) for keys, models in zip(self.ident.tenants, pipe.execute(),
                                                           strict=True)
                   for m in sorted(models) for lane in s.lanes]
        if not targets:
            return
        for _ in range(2):  # a second time after loading the scripts (Redis lost its cache)
            pipe = r.pipeline(transaction=False)
            for keys, model, lane in targets:
                script.queue(pipe, worker_scripts.ExpireUnserved(
                    keys, model, lane, s.unserved_timeout_s, s.result_ttl_s, 1000))
            results = pipe.execute(raise_on_error=False)
            if not script.noscript(results):
                break
            script.load(r, worker_scripts.NAMES)
        for (keys, model, lane), n in zip(targets, results, strict=True):
            if isinstance(n, Exception):
                self.log.warning("expire_unserved_failed", prefix=keys.prefix, model=model,
                                 lane=lane, error=str(n))
            elif n:
                self.log.warning("jobs_expired_unserved", prefix=keys.prefix, model=model,
                                 lane=lane, count=n)
