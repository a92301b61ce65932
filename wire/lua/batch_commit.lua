-- BATCH_COMMIT (batch/store.py). The collector's commit: drop the n items it has written
-- from the head of the done list
-- and count them, only while it still holds the tick lease (a collector that lost it
-- leaves the items to the next one: written twice at worst, never lost).
-- The output lines' usage is summed in the record (OpenAI's batch usage).
-- KEYS: 1 batch hash, 2 done list. ARGV: 1 token, 2 n, 3 cut, 4 input tokens, 5 output
-- tokens (of the output lines written). Reply: 1 | 0 (lease lost).
local cur = redis.call('HGET', KEYS[1], 'tick_lease')
if not cur or string.sub(cur, 1, #ARGV[1] + 1) ~= ARGV[1] .. '|' then return 0 end
redis.call('LTRIM', KEYS[2], tonumber(ARGV[2]), -1)
redis.call('HINCRBY', KEYS[1], 'collected', tonumber(ARGV[2]))
redis.call('HINCRBY', KEYS[1], 'cut', tonumber(ARGV[3]))
redis.call('HINCRBY', KEYS[1], 'usage_in', tonumber(ARGV[4] or '0'))
redis.call('HINCRBY', KEYS[1], 'usage_out', tonumber(ARGV[5] or '0'))
return 1
