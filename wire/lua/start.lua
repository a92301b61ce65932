-- START (worker): make this worker the owner of a job, right before it enters the engine.
-- KEYS: 1 job hash, 2 queued-tokens counter, 3 queued-jobs counter
-- ARGV: 1 worker id, 2 model, 3 max_deliveries
-- Reply: {'ok', attempt, deadline, was_status, queue_wait_s} | {'terminal', status}
--        | {'poison', attempts}
-- Poison = started max_deliveries times without a terminal result (each start bumps
-- attempt; jobs that merely sat in a crashed worker's batch of entries are not counted).
-- Times come from Redis's clock, as the producer's created_at does (no skew between hosts).
local now = now_str()
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
  leave_queue(KEYS[1], KEYS[2], KEYS[3])
  redis.call('HSET', KEYS[1], 'started_at', now)
end
redis.call('HSET', KEYS[1], 'attempt', tried + 1, 'status', 'running', 'worker', ARGV[1])
local created = tonumber(redis.call('HGET', KEYS[1], 'created_at') or '') or tonumber(now)
return {'ok', tried + 1, redis.call('HGET', KEYS[1], 'deadline') or '', st,
        string.format('%.6f', tonumber(now) - created)}
