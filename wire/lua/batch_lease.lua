-- BATCH_LEASE (batch/store.py). Take or refresh a lease held in a hash field as
-- "token|until"; with it, set the pairs.
-- KEYS: 1 batch hash. ARGV: 1 field, 2 token, 3 ttl_s, 4.. field/value pairs to set.
-- Reply: 1 held by us now, 0 held by another token, -1 no such batch.
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
