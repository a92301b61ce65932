"""Server-side scripts of the worker. Each runs atomically; each write to a job is fenced
by its ``attempt`` (a reclaiming worker bumps it, so a stale owner's writes are refused).

Event ``i`` of a job lives at out-stream id ``0-(i+1)``: XADD of an existing index fails,
so no event is ever written twice (see producer/keys.py).
"""
from __future__ import annotations

import hashlib

import redis


class Script:
    """One of the scripts below, run by EVALSHA. With ``client=pipeline`` it only queues
    the EVALSHA: redis-py's own Script objects make every pipeline.execute() send SCRIPT
    EXISTS first, one extra round trip per execute. A NOSCRIPT reply in a pipeline (Redis
    restarted or flushed its script cache) is the caller's to handle: ``load_all`` and
    send again (``noscript``). Every script here is fenced or idempotent, so a resend is
    safe. Called directly, it loads and retries by itself."""

    sources: set[str] = set()  # of every Script made: what load_all loads

    def __init__(self, r: redis.Redis, source: str) -> None:
        self.r, self.source = r, source
        self.sha = hashlib.sha1(source.encode()).hexdigest()
        Script.sources.add(source)

    def __call__(self, keys=(), args=(), client=None):
        if client is not None:
            client.evalsha(self.sha, len(keys), *keys, *args)
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
    """Load every script in use into Redis's script cache."""
    pipe = r.pipeline(transaction=False)
    for source in Script.sources:
        pipe.script_load(source)
    pipe.execute()


# KEYS: job hash, queued-tokens counter, queued-jobs counter.
# ARGV: worker id, model, max_deliveries.
# -> {'ok', attempt, deadline, was_status, queue_wait_s} | {'terminal', status}
#    | {'poison', attempts}
# Poison = started max_deliveries times without a terminal result (each start bumps
# attempt; jobs that merely sat in a crashed worker's batch of entries are not counted).
# Times come from Redis's clock, as the producer's created_at does (no skew between hosts).
START = r"""
local t = redis.call('TIME')
local now = t[1] .. '.' .. string.format('%06d', tonumber(t[2]))
local st = redis.call('HGET', KEYS[1], 'status')
if not st then
  -- an entry XADDed without the submit script: never counted as queued
  redis.call('HSET', KEYS[1], 'status', 'queued', 'model', ARGV[2], 'attempt', 0,
             'created_at', now, 'raw', 1)
  st = 'queued'
end
if st ~= 'queued' and st ~= 'running' then return {'terminal', st} end
local tried = tonumber(redis.call('HGET', KEYS[1], 'attempt') or '0') or 0
if tried >= tonumber(ARGV[3]) then return {'poison', tostring(tried)} end
if st == 'queued' then
  local q = tonumber(redis.call('HGET', KEYS[1], 'qtok') or '0') or 0
  if q > 0 then
    -- qtok is zeroed with the decrement so a job is subtracted at most once
    if tonumber(redis.call('DECRBY', KEYS[2], q)) < 0 then redis.call('SET', KEYS[2], 0) end
  end
  if redis.call('HGET', KEYS[1], 'raw') ~= '1' then
    if tonumber(redis.call('DECR', KEYS[3])) < 0 then redis.call('SET', KEYS[3], 0) end
  end
  redis.call('HSET', KEYS[1], 'started_at', now, 'qtok', 0)
end
redis.call('HSET', KEYS[1], 'attempt', tried + 1, 'status', 'running', 'worker', ARGV[1])
local created = tonumber(redis.call('HGET', KEYS[1], 'created_at') or '') or tonumber(now)
return {'ok', tried + 1, redis.call('HGET', KEYS[1], 'deadline') or '', st,
        string.format('%.6f', tonumber(now) - created)}
"""

# One call per publish round for every (job, choice) with new tokens.
# KEYS: job1, out1, job2, out2, ...   ARGV: maxlen, idle_ttl, then per event 8 values:
# attempt, index, delta, ids, logprobs-json-or-'', channel, choice-or-'', finish_reason-or-''.
# -> {events written, job ids no longer ours (attempt moved on, or already terminal)}
PUBLISH = r"""
local maxlen, ttl, n = ARGV[1], ARGV[2], #KEYS / 2
local written, lost = 0, {}
for j = 0, n - 1 do
  local jk, ok = KEYS[2 * j + 1], KEYS[2 * j + 2]
  local b = 2 + 8 * j
  -- pcall: a key of another type (a hostile producer) must not fail the whole batch
  local okh, h = pcall(redis.call, 'HMGET', jk, 'attempt', 'status')
  if okh and h[1] == ARGV[b + 1] and h[2] == 'running' then
    local idx = tonumber(ARGV[b + 2])
    local f = {'t', 'token', 'i', ARGV[b + 2], 'd', ARGV[b + 3], 'ids', ARGV[b + 4]}
    local m = {t = 'token', i = ARGV[b + 2], d = ARGV[b + 3], ids = ARGV[b + 4]}
    if ARGV[b + 5] ~= '' then
      f[#f + 1] = 'lp'; f[#f + 1] = ARGV[b + 5]; m.lp = ARGV[b + 5]
    end
    if ARGV[b + 7] ~= '' then
      f[#f + 1] = 'c'; f[#f + 1] = ARGV[b + 7]; m.c = ARGV[b + 7]
    end
    if ARGV[b + 8] ~= '' then
      f[#f + 1] = 'fr'; f[#f + 1] = ARGV[b + 8]; m.fr = ARGV[b + 8]
    end
    local r = redis.pcall('XADD', ok, 'MAXLEN', '~', maxlen, '0-' .. (idx + 1), unpack(f))
    if type(r) == 'string' then
      redis.call('PUBLISH', ARGV[b + 6], cjson.encode(m))
      written = written + 1
    end
    redis.call('EXPIRE', ok, ttl)
  else
    lost[#lost + 1] = string.match(jk, ':job:(.*)$')
  end
end
return {written, lost}
"""

# KEYS: job hash, out stream, jobs stream, cancel set
# ARGV: attempt, status, finish_reason, text, error, prompt_tokens, completion_tokens,
#       index, ttl, entry_id, group, job_id, channel, now, maxlen, choices-json-or-''
# -> 'ok' | 'dup' (already terminal under our attempt: just acked) | 'fenced' (not ours)
FINISH = r"""
local h = redis.call('HMGET', KEYS[1], 'attempt', 'status')
if h[1] ~= ARGV[1] then return 'fenced' end
local st = h[2]
if st == 'finished' or st == 'failed' or st == 'cancelled' or st == 'expired' then
  if ARGV[10] ~= '' then
    redis.call('XACK', KEYS[3], ARGV[11], ARGV[10])
    redis.call('XDEL', KEYS[3], ARGV[10])
  end
  return 'dup'
end
local choices = ARGV[16] or ''
redis.call('HSET', KEYS[1], 'status', ARGV[2], 'finish_reason', ARGV[3], 'text', ARGV[4],
           'error', ARGV[5], 'prompt_tokens', ARGV[6], 'completion_tokens', ARGV[7],
           'finished_at', ARGV[14])
local ev = {'t', 'final', 'i', ARGV[8], 'status', ARGV[2], 'fr', ARGV[3], 'text', ARGV[4],
            'err', ARGV[5], 'pt', ARGV[6], 'ct', ARGV[7]}
local msg = {t = 'final', i = ARGV[8], status = ARGV[2], fr = ARGV[3], text = ARGV[4],
             err = ARGV[5], pt = ARGV[6], ct = ARGV[7]}
if choices ~= '' then
  redis.call('HSET', KEYS[1], 'choices', choices)
  ev[#ev + 1] = 'choices'; ev[#ev + 1] = choices; msg.choices = choices
end
local idx = tonumber(ARGV[8])
redis.pcall('XADD', KEYS[2], 'MAXLEN', '~', ARGV[15], '0-' .. (idx + 1), unpack(ev))
redis.call('PUBLISH', ARGV[13], cjson.encode(msg))
redis.call('EXPIRE', KEYS[1], ARGV[9])
redis.call('EXPIRE', KEYS[2], ARGV[9])
redis.call('SREM', KEYS[4], ARGV[12])
-- the entry is not needed once its job is terminal: keep the jobs stream bounded
if ARGV[10] ~= '' then
  redis.call('XACK', KEYS[3], ARGV[11], ARGV[10])
  redis.call('XDEL', KEYS[3], ARGV[10])
end
return 'ok'
"""

# A stream entry that cannot become a job (undecodable, invalid, poison, refused by the
# engine): dead-letter it (body truncated by the caller; entries older than the DLQ's
# retention trimmed by MINID, the key expires when idle), fail its job record if it has a
# usable one that is not terminal yet (a queued one leaves the queue counters exactly
# once, as in START), and ack + delete the entry.
# KEYS: jobs stream, dlq stream, job hash, out stream, queued-tokens, queued-jobs counters
# ARGV: group, entry_id, reason, job_id-or-'', body, now, ttl, channel, deliveries,
#       dlq retention seconds
REJECT = r"""
local t = redis.call('TIME')
local min_id = (tonumber(t[1]) - tonumber(ARGV[10])) * 1000
redis.call('XADD', KEYS[2], 'MINID', '~', tostring(math.max(min_id, 0)), '*', 'entry', ARGV[2],
           'job', ARGV[4], 'reason', ARGV[3], 'body', ARGV[5], 'deliveries', ARGV[9],
           'at', ARGV[6])
redis.call('EXPIRE', KEYS[2], ARGV[10])
if ARGV[4] ~= '' then
  -- a hostile producer may have left any type at the job key: never let it stop the ack
  local ok, st = pcall(redis.call, 'HGET', KEYS[3], 'status')
  if ok and ((not st) or st == 'queued' or st == 'running') then
    if st == 'queued' and redis.call('HGET', KEYS[3], 'raw') ~= '1' then
      local q = tonumber(redis.call('HGET', KEYS[3], 'qtok') or '0') or 0
      if q > 0 and tonumber(redis.call('DECRBY', KEYS[5], q)) < 0 then
        redis.call('SET', KEYS[5], 0)
      end
      if tonumber(redis.call('DECR', KEYS[6])) < 0 then redis.call('SET', KEYS[6], 0) end
    end
    local idx = 0
    local okl, last = pcall(redis.call, 'XREVRANGE', KEYS[4], '+', '-', 'COUNT', 1)
    if not okl then
      redis.call('DEL', KEYS[4])
    elseif #last > 0 then
      idx = tonumber(string.match(last[1][1], '%d+$'))
    end
    redis.call('HSET', KEYS[3], 'status', 'failed', 'finish_reason', 'error',
               'error', ARGV[3], 'finished_at', ARGV[6], 'qtok', 0)
    redis.pcall('XADD', KEYS[4], '0-' .. (idx + 1), 't', 'final', 'i', idx,
                'status', 'failed', 'fr', 'error', 'text', '', 'err', ARGV[3], 'pt', 0, 'ct', 0)
    redis.call('PUBLISH', ARGV[8], cjson.encode({t = 'final', i = tostring(idx),
               status = 'failed', fr = 'error', text = '', err = ARGV[3], pt = '0', ct = '0'}))
    redis.call('EXPIRE', KEYS[3], ARGV[7])
    redis.call('EXPIRE', KEYS[4], ARGV[7])
  end
end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
return 'ok'
"""

# Jobs of a model that no live worker serves: each queued job older than the unserved
# timeout ends 'expired' (finish_reason 'no_worker'), leaves the queue counters, and its
# entry is deleted. Run by any worker's housekeeping (of any model) when the model's
# serving set has no live member.
# KEYS: jobs stream, serving zset, queued-tokens, queued-jobs counters, cancel set
# ARGV: key base ('{P}'), unserved timeout seconds, ttl, max entries to look at
# -> number of jobs expired
EXPIRE_UNSERVED = r"""
local t = redis.call('TIME')
if redis.call('ZCOUNT', KEYS[2], t[1], '+inf') > 0 then return 0 end
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local nows = string.format('%.6f', now)
local limit = now - tonumber(ARGV[2])
local n = 0
for _, e in ipairs(redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', tonumber(ARGV[4]))) do
  local f, id = e[2], nil
  for i = 1, #f, 2 do if f[i] == 'job' then id = f[i + 1] end end
  local created = tonumber(string.match(e[1], '^(%d+)')) / 1000
  if id and created < limit then
    local jk, ok = ARGV[1] .. ':job:' .. id, ARGV[1] .. ':out:' .. id
    local okh, h = pcall(redis.call, 'HMGET', jk, 'status', 'raw', 'qtok')
    if okh and h[1] == 'queued' then
      if h[2] ~= '1' then
        local q = tonumber(h[3] or '0') or 0
        if q > 0 and tonumber(redis.call('DECRBY', KEYS[3], q)) < 0 then
          redis.call('SET', KEYS[3], 0)
        end
        if tonumber(redis.call('DECR', KEYS[4])) < 0 then redis.call('SET', KEYS[4], 0) end
      end
      local err = 'no worker served this model for ' .. ARGV[2] .. ' s'
      redis.call('HSET', jk, 'status', 'expired', 'finish_reason', 'no_worker', 'error', err,
                 'finished_at', nows, 'qtok', 0)
      redis.pcall('XADD', ok, '0-1', 't', 'final', 'i', 0, 'status', 'expired',
                  'fr', 'no_worker', 'text', '', 'err', err, 'pt', 0, 'ct', 0)
      redis.call('PUBLISH', ARGV[1] .. ':chan:' .. id, cjson.encode({t = 'final', i = '0',
                 status = 'expired', fr = 'no_worker', text = '', err = err, pt = '0', ct = '0'}))
      redis.call('EXPIRE', jk, ARGV[3])
      redis.call('EXPIRE', ok, ARGV[3])
      redis.call('SREM', KEYS[5], id)
      redis.call('XACK', KEYS[1], 'workers', e[1])
      redis.call('XDEL', KEYS[1], e[1])
      n = n + 1
    elseif okh and not h[1] then  -- XADDed without the submit script: no one to tell
      redis.call('XACK', KEYS[1], 'workers', e[1])
      redis.call('XDEL', KEYS[1], e[1])
    end
  end
end
return n
"""

# Lease refresh: reset the idle time of entries this worker still owns, so live
# long-running jobs are not reclaimed. Fenced: an entry whose job attempt moved on
# (reclaimed by another worker) is left alone, never claimed back.
# KEYS: jobs stream, job hash 1..n   ARGV: group, consumer, then entry_id, attempt per job
REFRESH = r"""
local n = 0
for j = 2, #KEYS do
  local b = 3 + 2 * (j - 2)
  if redis.call('HGET', KEYS[j], 'attempt') == ARGV[b + 1] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[b], 'JUSTID')
    n = n + 1
  end
end
return n
"""
