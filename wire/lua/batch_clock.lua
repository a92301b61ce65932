-- BATCH_CLOCK (batch/store.py): Redis's clock, and until when a lease is held.
-- KEYS: 1 batch hash. ARGV: 1 lease field. Reply: {now, lease until or "0"}.
local cur = redis.call('HGET', KEYS[1], ARGV[1]) or ''
local untl = string.match(cur, '|([^|]*)$') or '0'
return {fmt(now()), untl}
