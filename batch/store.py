"""The batch record in Redis: the hash ``keys.batch(id)`` in the batch's partition (the
one its id names, where its jobs are: wire/keys.py) and the index ``keys.batches`` in
partition 0.

Fields of the hash (all strings; times are Redis TIME, epoch seconds):

    status, model, completion_window, window_s, created_at, expires_at, <status>_at
    queue (the rq queue of its ingest and tick jobs), folder, input_file, output_file, error_file, input_bytes, input_sha256, retry_of, metadata
    lines (non-blank input lines)                                          the submit
    checked (lines validated so far, every 1000), total (valid lines), invalid   the ingest
    validated=1, cursor (next line to submit), cursor_off (its byte offset),
    submitted (jobs created for lines < cursor), ingested=1 (no more SUBMITs)    the ingest
    paused=1 (the ingest gave its lease up with its window full: ticks resume it)
    completed, failed, n_<status>         the service, atomically as each job ends
    collected, cut                        the collector, atomically with its trim
    final_completed, final_failed, errors the finalizer (or the ingest, for "failed")
    chain, beat                           the current tick chain and its last sign of life
    ingest_lease, tick_lease              "token|until": one ingest, one collector at a time

Every write below is one script (wire/lua/batch_*.lua, called through
pagedq.wire.batch_scripts: atomic, fenced where it must be), so each step of the control
plane may be repeated after a crash.
"""
from __future__ import annotations

from typing import Any

from pagedq.wire import script
from pagedq.wire.batch_scripts import Clock, Commit, CreateBatch, Lease, Rearm, Release, Transition
from pagedq.wire.keys import Keys


class BatchStore:
    """The record's Redis calls, on a sync redis-py client with decoded replies. ``keys``:
    the tenant's (any partition); a batch's record is in the partition its id names."""

    def __init__(self, r: Any, keys: Keys, partitions: int = 1) -> None:
        self.r, self.keys, self.partitions = r, keys.home, partitions

    def _k(self, batch_id: str) -> Keys:
        return self.keys.of_job(batch_id, self.partitions)

    def _record(self, batch_id: str) -> str:
        return self._k(batch_id).batch(batch_id)

    def create(self, batch_id: str, window_s: int, fields: dict[str, Any]) -> float:
        k = self._k(batch_id)
        together = k.partition == 0  # the record and the index in one slot: one script
        created = script.run(self.r, CreateBatch(k.batch(batch_id), batch_id, window_s, fields,
                                                 self.keys.batches if together else None))
        if not together:
            self.r.zadd(self.keys.batches, {batch_id: created})
        return created

    def get(self, batch_id: str) -> dict[str, str]:
        return self.r.hgetall(self._record(batch_id))

    def lease(self, batch_id: str, field: str, token: str, ttl_s: float,
              **fields: Any) -> int:
        return script.run(self.r, Lease(self._record(batch_id), field, token, ttl_s, fields))

    def release(self, batch_id: str, field: str, token: str) -> None:
        script.run(self.r, Release(self._record(batch_id), field, token))

    def commit(self, batch_id: str, token: str, n: int, cut: int,
               usage: tuple[int, int] = (0, 0)) -> bool:
        k = self._k(batch_id)
        return script.run(self.r, Commit(k.batch(batch_id), k.batch_done(batch_id), token, n,
                                         cut, usage))

    def transition(self, batch_id: str, frm: tuple[str, ...], to: str, ttl_s: int = 0,
                   **fields: Any) -> tuple[bool, str]:
        k = self._k(batch_id)
        return script.run(self.r, Transition(k.batch(batch_id), k.batch_done(batch_id), frm,
                                             to, ttl_s, fields))

    def clock(self, batch_id: str, lease_field: str = "ingest_lease") -> tuple[float, float]:
        """(Redis time now, until when ``lease_field`` is held)."""
        return script.run(self.r, Clock(self._record(batch_id), lease_field))

    def rearm(self, batch_id: str, chain: str, stale_s: float, queue: str) -> bool:
        return script.run(self.r, Rearm(self._record(batch_id), chain, stale_s, queue))

    def recent_ids(self, since: float) -> list[str]:
        return self.r.zrangebyscore(self.keys.batches, since, "+inf")
