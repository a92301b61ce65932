-- BATCH_RELEASE (batch/store.py): give a lease up.
-- KEYS: 1 batch hash. ARGV: 1 field, 2 token. Drops the lease if we hold it.
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if cur and string.sub(cur, 1, #ARGV[2] + 1) == ARGV[2] .. '|' then
  redis.call('HDEL', KEYS[1], ARGV[1])
end
return 1
