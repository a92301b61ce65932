-- EXPIRE_UNSERVED (worker): jobs of a model that no live worker serves. Each queued job
-- older than the unserved timeout ends 'expired' (finish_reason 'no_worker'), leaves the
-- queue counters, and its entry (or its inbox item) is deleted. Run by any worker's
-- housekeeping (of any model) when the model's serving set has no live member.
-- KEYS: 1 jobs stream, 2 serving zset, 3 queued-tokens, 4 queued-jobs counters, 5 cancel set,
--       6 inbox list
-- ARGV: 1 key base ('{P}'), 2 unserved timeout seconds, 3 ttl, 4 max entries to look at
-- Reply: number of jobs expired
if live_count(KEYS[2]) > 0 then return 0 end
local nows = now_str()
local limit = tonumber(nows) - tonumber(ARGV[2])
local n = 0
local function expire(id)
  local jk, ok = ARGV[1] .. ':job:' .. id, ARGV[1] .. ':out:' .. id
  leave_queue(jk, KEYS[3], KEYS[4])
  local err = 'no worker served this model for ' .. ARGV[2] .. ' s'
  redis.call('HSET', jk, 'status', 'expired', 'finish_reason', 'no_worker', 'error', err,
             'finished_at', nows)
  count_in_batch(jk, 'expired')
  write_final(ok, ARGV[1] .. ':chan:' .. id, last_index(ok) + 1, 'expired', 'no_worker',
              '', err, 0, 0)
  redis.call('EXPIRE', jk, ARGV[3])
  redis.call('EXPIRE', ok, ARGV[3])
  redis.call('SREM', KEYS[5], id)
  n = n + 1
end
for _, e in ipairs(redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', tonumber(ARGV[4]))) do
  local f, id = e[2], nil
  for i = 1, #f, 2 do if f[i] == 'job' then id = f[i + 1] end end
  local created = tonumber(string.match(e[1], '^(%d+)')) / 1000
  if id and created < limit then
    local okh, st = pcall(redis.call, 'HGET', ARGV[1] .. ':job:' .. id, 'status')
    if okh and st == 'queued' then expire(id) end
    if okh and (st == 'queued' or not st) then  -- no record: XADDed without SUBMIT
      redis.call('XACK', KEYS[1], 'workers', e[1])
      redis.call('XDEL', KEYS[1], e[1])
    end
  end
end
-- The inbox, oldest first: items of jobs no longer queued (or without a record) are
-- dropped on the way; the first queued job younger than the limit ends the sweep.
for _ = 1, tonumber(ARGV[4]) do
  local item = redis.call('LINDEX', KEYS[6], 0)
  if not item then break end
  local id = string.match(item, '^([^\n]*)\n') or ''
  local h = {false, false}
  if valid_id(id) then
    local okh, got = pcall(redis.call, 'HMGET', ARGV[1] .. ':job:' .. id, 'status', 'created_at')
    if okh then h = got end
  end
  if h[1] == 'queued' and (tonumber(h[2]) or 0) >= limit then break end
  redis.call('LPOP', KEYS[6])
  if h[1] == 'queued' then expire(id) end
end
return n
