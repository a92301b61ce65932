"""The batch record in Redis: the hash ``keys.batch(id)`` in the batch's partition (the
one its id names, where its jobs are: wire/keys.py) and the index ``keys.batches`` in
partition 0.

Fields of the hash (all strings; times are Redis TIME, epoch seconds):

    status, model, completion_window, window_s, created_at, expires_at, <status>_at
    queue (the rq queue of its ingest and tick jobs), folder, input_file, output_file, error_file, input_bytes, input_sha256, retry_of, metadata
    lines (non-blank input lines), total (valid lines), invalid          the ingest, once
    validated=1, cursor (next line to submit), cursor_off (its byte offset),
    submitted (jobs created for lines < cursor), ingested=1 (no more SUBMITs)    the ingest
    completed, failed, n_<status>         the service, atomically as each job ends
    collected, cut                        the collector, atomically with its trim
    final_completed, final_failed, errors the finalizer (or the ingest, for "failed")
    chain, beat                           the current tick chain and its last sign of life
    ingest_lease, tick_lease              "token|until": one ingest, one collector at a time

Every write below is one script (atomic, fenced where it must be), so each step of the
control plane may be repeated after a crash.
"""
from __future__ import annotations

from typing import Any

from pagedq.wire.keys import Keys

_NOW = """
local function now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1e6
end
local function fmt(x) return string.format('%.6f', x) end
"""

# KEYS: 1 batch hash, 2 batches zset (only when both are in one partition: the caller
# adds the id to the index itself otherwise). ARGV: 1 id, 2 window_s, 3.. field/value
# pairs. Reply: {"created", created_at} | {"exists", ""}
CREATE_LUA = _NOW + """
if redis.call('EXISTS', KEYS[1]) == 1 then return {'exists', ''} end
local t = now()
redis.call('HSET', KEYS[1], 'status', 'validating', 'created_at', fmt(t),
           'expires_at', fmt(t + tonumber(ARGV[2])), 'beat', fmt(t), unpack(ARGV, 3))
if KEYS[2] then redis.call('ZADD', KEYS[2], t, ARGV[1]) end
return {'created', fmt(t)}
"""

# Take or refresh a lease held in a hash field as "token|until"; with it, set the pairs.
# KEYS: 1 batch hash. ARGV: 1 field, 2 token, 3 ttl_s, 4.. field/value pairs to set.
# Reply: 1 held by us now, 0 held by another token, -1 no such batch.
LEASE_LUA = _NOW + """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local cur = redis.call('HGET', KEYS[1], ARGV[1])
local t = now()
if cur then
  local tok, untl = string.match(cur, '^(.*)|([^|]*)$')
  if tok and tok ~= ARGV[2] and tonumber(untl) and tonumber(untl) > t then return 0 end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. '|' .. fmt(t + tonumber(ARGV[3])))
if #ARGV > 3 then redis.call('HSET', KEYS[1], unpack(ARGV, 4)) end
return 1
"""

# KEYS: 1 batch hash. ARGV: 1 field, 2 token. Drops the lease if we hold it.
RELEASE_LUA = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if cur and string.sub(cur, 1, #ARGV[2] + 1) == ARGV[2] .. '|' then
  redis.call('HDEL', KEYS[1], ARGV[1])
end
return 1
"""

# The collector's commit: drop the n items it has written from the head of the done list
# and count them, only while it still holds the tick lease (a collector that lost it
# leaves the items to the next one: written twice at worst, never lost).
# KEYS: 1 batch hash, 2 done list. ARGV: 1 token, 2 n, 3 cut. Reply: 1 | 0 (lease lost).
COMMIT_LUA = """
local cur = redis.call('HGET', KEYS[1], 'tick_lease')
if not cur or string.sub(cur, 1, #ARGV[1] + 1) ~= ARGV[1] .. '|' then return 0 end
redis.call('LTRIM', KEYS[2], tonumber(ARGV[2]), -1)
redis.call('HINCRBY', KEYS[1], 'collected', tonumber(ARGV[2]))
redis.call('HINCRBY', KEYS[1], 'cut', tonumber(ARGV[3]))
return 1
"""

# Status change, only from the listed statuses; stamps <to>_at. A terminal status gets the
# record TTL and drops the (drained) done list.
# KEYS: 1 batch hash, 2 done list. ARGV: 1 from (comma list), 2 to, 3 ttl_s (0: none),
# 4.. field/value pairs. Reply: {"ok", to} | {"no", current status or ""}.
TRANSITION_LUA = _NOW + """
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return {'no', ''} end
local allowed = false
for s in string.gmatch(ARGV[1], '[^,]+') do if s == st then allowed = true end end
if not allowed then return {'no', st} end
redis.call('HSET', KEYS[1], 'status', ARGV[2], ARGV[2] .. '_at', fmt(now()))
if #ARGV > 3 then redis.call('HSET', KEYS[1], unpack(ARGV, 4)) end
if tonumber(ARGV[3]) > 0 then
  redis.call('EXPIRE', KEYS[1], tonumber(ARGV[3]))
  redis.call('DEL', KEYS[2])
end
return {'ok', ARGV[2]}
"""

# KEYS: 1 batch hash. ARGV: 1 lease field. Reply: {now, lease until or "0"}.
CLOCK_LUA = _NOW + """
local cur = redis.call('HGET', KEYS[1], ARGV[1]) or ''
local untl = string.match(cur, '|([^|]*)$') or '0'
return {fmt(now()), untl}
"""


# Start a new tick chain if the batch (of this rq queue) runs and its chain showed no life
# for stale_s. KEYS: 1 batch hash. ARGV: 1 new chain token, 2 stale_s, 3 queue.
# Reply: 1 re-armed, 0 not needed.
REARM_LUA = _NOW + """
local h = redis.call('HMGET', KEYS[1], 'status', 'beat', 'queue')
local st = h[1]
if not st or st == 'completed' or st == 'failed' or st == 'expired' or st == 'cancelled'
   or h[3] ~= ARGV[3] then
  return 0
end
local t = now()
if tonumber(h[2] or '0') + tonumber(ARGV[2]) > t then return 0 end
redis.call('HSET', KEYS[1], 'chain', ARGV[1], 'beat', fmt(t))
return 1
"""


def _flat(pairs: dict[str, Any]) -> list[str]:
    return [str(x) for kv in pairs.items() for x in kv]


class BatchStore:
    """The record's Redis calls, on a sync redis-py client with decoded replies. ``keys``:
    the tenant's (any partition); a batch's record is in the partition its id names."""

    def __init__(self, r: Any, keys: Keys, partitions: int = 1) -> None:
        self.r, self.keys, self.partitions = r, keys.home, partitions
        self._create = r.register_script(CREATE_LUA)
        self._lease = r.register_script(LEASE_LUA)
        self._release = r.register_script(RELEASE_LUA)
        self._commit = r.register_script(COMMIT_LUA)
        self._transition = r.register_script(TRANSITION_LUA)
        self._clock = r.register_script(CLOCK_LUA)
        self._rearm = r.register_script(REARM_LUA)

    def _k(self, batch_id: str) -> Keys:
        return self.keys.of_job(batch_id, self.partitions)

    def create(self, batch_id: str, window_s: int, fields: dict[str, Any]) -> float:
        k = self._k(batch_id)
        together = k.partition == 0  # the record and the index in one slot: one script
        reply = self._create([k.batch(batch_id), *([self.keys.batches] if together else [])],
                             [batch_id, str(window_s), *_flat(fields)])
        if reply[0] != "created":
            raise ValueError(f"batch {batch_id} exists already")
        if not together:
            self.r.zadd(self.keys.batches, {batch_id: float(reply[1])})
        return float(reply[1])

    def get(self, batch_id: str) -> dict[str, str]:
        return self.r.hgetall(self._k(batch_id).batch(batch_id))

    def lease(self, batch_id: str, field: str, token: str, ttl_s: float,
              **fields: Any) -> int:
        return int(self._lease([self._k(batch_id).batch(batch_id)],
                               [field, token, str(ttl_s), *_flat(fields)]))

    def release(self, batch_id: str, field: str, token: str) -> None:
        self._release([self._k(batch_id).batch(batch_id)], [field, token])

    def commit(self, batch_id: str, token: str, n: int, cut: int) -> bool:
        k = self._k(batch_id)
        return bool(self._commit([k.batch(batch_id), k.batch_done(batch_id)],
                                 [token, str(n), str(cut)]))

    def transition(self, batch_id: str, frm: tuple[str, ...], to: str, ttl_s: int = 0,
                   **fields: Any) -> tuple[bool, str]:
        k = self._k(batch_id)
        ok, st = self._transition([k.batch(batch_id), k.batch_done(batch_id)],
                                  [",".join(frm), to, str(ttl_s), *_flat(fields)])
        return ok == "ok", st

    def clock(self, batch_id: str, lease_field: str = "ingest_lease") -> tuple[float, float]:
        """(Redis time now, until when ``lease_field`` is held)."""
        now, until = self._clock([self._k(batch_id).batch(batch_id)], [lease_field])
        return float(now), float(until)

    def rearm(self, batch_id: str, chain: str, stale_s: float, queue: str) -> bool:
        return bool(self._rearm([self._k(batch_id).batch(batch_id)],
                                [chain, str(stale_s), queue]))

    def recent_ids(self, since: float) -> list[str]:
        return self.r.zrangebyscore(self.keys.batches, since, "+inf")
