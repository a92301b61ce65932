-- PUBLISH (worker): one call per publish round for every (job, choice) with new tokens.
-- KEYS: job1, out1, job2, out2, ...   ARGV: maxlen, idle_ttl, then per event 10 values:
-- attempt, index, delta, ids, logprobs-json-or-'', channel, choice-or-'', finish_reason-or-'',
-- prompt-tokens-or-'', prompt-logprobs-json-or-'' (the last two: a job's event 0 only).
-- Reply: {events written, positions (0-based, in KEYS pairs) of the jobs no longer ours
--         (attempt moved on, or already terminal)}
local maxlen, ttl, n = ARGV[1], ARGV[2], #KEYS / 2
local OPTIONAL = {{5, 'lp'}, {7, 'c'}, {8, 'fr'}, {9, 'pt'}, {10, 'plp'}}  -- ARGV offset, field
local written, lost = 0, {}
for j = 0, n - 1 do
  local jk, ok = KEYS[2 * j + 1], KEYS[2 * j + 2]
  local b = 2 + 10 * j
  -- pcall: a key of another type (a hostile producer) must not fail the whole batch
  local okh, h = pcall(redis.call, 'HMGET', jk, 'attempt', 'status')
  if okh and h[1] == ARGV[b + 1] and h[2] == 'running' then
    local f = {'t', 'token', 'i', ARGV[b + 2], 'd', ARGV[b + 3], 'ids', ARGV[b + 4]}
    local m = {t = 'token', i = ARGV[b + 2], d = ARGV[b + 3], ids = ARGV[b + 4]}
    for _, o in ipairs(OPTIONAL) do  -- the fields an event carries only when set
      local v = ARGV[b + o[1]]
      if v ~= '' then
        f[#f + 1] = o[2]; f[#f + 1] = v; m[o[2]] = v
      end
    end
    local r = add_event(ok, 'MAXLEN', '~', maxlen, out_id(ARGV[b + 2]), unpack(f))
    if type(r) == 'string' then
      redis.call('PUBLISH', ARGV[b + 6], cjson.encode(m))
      written = written + 1
    end
    redis.call('EXPIRE', ok, ttl)
  else
    lost[#lost + 1] = j
  end
end
return {written, lost}
