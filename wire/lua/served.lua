-- SERVED: the models with live workers.
-- KEYS: 1 models set   ARGV: 1 key base '{P}'
-- Reply: {model, live worker count, ...} for every model of the set (serving scores are
-- heartbeat expiry times: a member scored below Redis TIME is dead)
local _, t = now_str()
local reply = {}
for _, m in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  reply[#reply + 1] = m
  reply[#reply + 1] = redis.call('ZCOUNT', ARGV[1] .. ':serving:' .. m, t[1], '+inf')
end
return reply
