-- BATCH_TRANSITION (batch/store.py). Status change, only from the listed statuses; stamps
-- <to>_at. A terminal status gets the
-- record TTL and drops the (drained) done list.
-- KEYS: 1 batch hash, 2 done list. ARGV: 1 from (comma list), 2 to, 3 ttl_s (0: none),
-- 4.. field/value pairs. Reply: {"ok", to} | {"no", current status or ""}.
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
