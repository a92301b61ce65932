-- ADMIT (gateway): look an API key up and charge its rate window one request and the
-- request's estimated tokens (gateway/apikeys.py).
-- KEYS: 1 the apikeys hash. ARGV: 1 key hash, 2 estimated tokens, 3 mode (auto|on),
-- 4 key base '{P}', 5 the key's record as JSON when the store is a file ('' = look it up).
-- The window key is derived from ARGV 4 (same hash tag: same Redis Cluster slot).
-- Reply: {'open'} (auto and no key exists) | {'unknown'} | {'limited', what, retry_s, cap}
--        | {'ok', record JSON, window key}
local t = redis.call('TIME')
local now = tonumber(t[1])
local rec = ARGV[5]
if rec == '' then
  rec = redis.call('HGET', KEYS[1], ARGV[1])
  if not rec then
    if ARGV[3] == 'auto' and redis.call('HLEN', KEYS[1]) == 0 then return {'open'} end
    return {'unknown'}
  end
end
local r = cjson.decode(rec)
local window = ARGV[4] .. ':ratelimit:' .. ARGV[1] .. ':' .. math.floor(now / 60)
local used = redis.call('HMGET', window, 'r', 't')
local nr, nt = tonumber(used[1] or '0'), tonumber(used[2] or '0')
local rpm, tpm, est = tonumber(r.rpm or 0), tonumber(r.tpm or 0), tonumber(ARGV[2])
local retry = tostring(60 - now % 60)
if rpm > 0 and nr >= rpm then return {'limited', 'requests', retry, tostring(rpm)} end
if tpm > 0 and nt > 0 and nt + est > tpm then return {'limited', 'tokens', retry, tostring(tpm)} end
redis.call('HINCRBY', window, 'r', 1)
redis.call('HINCRBY', window, 't', est)
redis.call('EXPIRE', window, 120)
return {'ok', rec, window}
