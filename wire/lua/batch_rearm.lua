-- BATCH_REARM (batch/store.py). Start a new tick chain if the batch (of this rq queue) runs
-- and its chain showed no life
-- for stale_s. KEYS: 1 batch hash. ARGV: 1 new chain token, 2 stale_s, 3 queue.
-- Reply: 1 re-armed, 0 not needed.
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
