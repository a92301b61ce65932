-- SETTLE (gateway): correct a rate window's tokens once the request's job ended.
-- KEYS: 1 a window key from ADMIT. ARGV: 1 tokens to add (negative: to give back).
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HINCRBY', KEYS[1], 't', ARGV[1]) end
return 0
