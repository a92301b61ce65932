-- SERVED: the models with live workers.
-- KEYS: 1 models set   ARGV: 1 key base '{P}'
-- Reply: {model, live worker count, ...} for every model of the set (serving scores are
-- heartbeat expiry times: a member scored below Redis TIME is dead)
if #KEYS ~= 1 or ARGV[1] == nil or key_base(KEYS[1]) ~= ARGV[1]
   or KEYS[1] ~= ARGV[1] .. ':models' then
  return redis.error_reply('ERR pagedq SERVED: KEYS[1] must be {P}:models and ARGV[1] its {P}')
end
local reply = {}
for _, m in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  reply[#reply + 1] = m
  reply[#reply + 1] = live_count(ARGV[1] .. ':serving:' .. m)
end
return reply
