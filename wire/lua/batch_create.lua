-- BATCH_CREATE (batch/store.py): a new batch's record, and its entry in the batches index.
-- KEYS: 1 batch hash, 2 batches zset (only when both are in one partition: the caller
-- adds the id to the index itself otherwise). ARGV: 1 id, 2 window_s, 3.. field/value
-- pairs. Reply: {"created", created_at} | {"exists", ""}
if redis.call('EXISTS', KEYS[1]) == 1 then return {'exists', ''} end
local t = now()
redis.call('HSET', KEYS[1], 'status', 'validating', 'created_at', fmt(t),
           'expires_at', fmt(t + tonumber(ARGV[2])), 'beat', fmt(t), unpack(ARGV, 3))
if KEYS[2] then redis.call('ZADD', KEYS[2], t, ARGV[1]) end
return {'created', fmt(t)}
