-- QUEUE_SNAPSHOT: the queue counters of a model and what they should be (invariants.py).
-- KEYS: 1 jobs stream, 2 queued-tokens counter, 3 queued-jobs counter, 4 inbox list
-- ARGV: 1 key base
-- Reply: {counted jobs, counted tokens, qjobs counter, qtokens counter}
local jobs, tokens, seen = 0, 0, {}
local function count(id)
  if id and not seen[id] then
    seen[id] = true
    local ok, h = pcall(redis.call, 'HMGET', ARGV[1] .. ':job:' .. id, 'status', 'raw', 'qtok')
    if ok and h[1] == 'queued' and h[2] ~= '1' then
      jobs = jobs + 1
      tokens = tokens + (tonumber(h[3] or '0') or 0)
    end
  end
end
for _, e in ipairs(redis.call('XRANGE', KEYS[1], '-', '+')) do
  local f, id = e[2], nil
  for i = 1, #f, 2 do if f[i] == 'job' then id = f[i + 1] end end
  count(id)
end
for _, item in ipairs(redis.call('LRANGE', KEYS[4], 0, -1)) do
  count(string.match(item, '^([^\n]*)\n'))
end
return {jobs, tokens, tonumber(redis.call('GET', KEYS[3]) or '0') or -1,
        tonumber(redis.call('GET', KEYS[2]) or '0') or -1}
