-- CANCEL: cancel a queued job at once, or ask the owning worker to stop a running one.
-- KEYS: 1 job hash, 2 out stream, 3 cancel set
-- ARGV: 1 job id, 2 cancelled_ttl_s (TTL of the record of a job cancelled while queued), 3 pub/sub channel, 4 queued-tokens key prefix
--       ('<model>:<lane>' appended), 5 queued-jobs key prefix (the same); the derived keys
--       are in the same slot as the declared ones
-- Reply: "missing" | "terminal" | "cancelled" (was queued) | "requested" (was running);
-- an error reply for a call whose KEYS and ARGV are not those of one job (nothing written)
local job, out, cset = KEYS[1], KEYS[2], KEYS[3]
local base, id = key_base(job or ''), ARGV[1] or ''
if #KEYS ~= 3 or #ARGV ~= 5 or not base or not valid_id(id) or job ~= base .. ':job:' .. id
   or out ~= base .. ':out:' .. id or cset ~= base .. ':cancel'
   or ARGV[3] ~= base .. ':chan:' .. id or ARGV[4] ~= base .. ':qtokens:'
   or ARGV[5] ~= base .. ':qjobs:' then
  return redis.error_reply('ERR pagedq CANCEL: KEYS and ARGV must name one job of one key '
                           .. 'space (docs/protocol.md "Cancelling")')
end
if string.find(ARGV[2], '^%d+$') == nil or #ARGV[2] > 10 or tonumber(ARGV[2]) < 1 then
  return redis.error_reply('ERR pagedq CANCEL: cancelled_ttl_s must be a positive integer')
end
local st = redis.call('HGET', job, 'status')
if not st then return 'missing' end
if st == 'running' then
  redis.call('SADD', cset, ARGV[1])
  return 'requested'
end
if st ~= 'queued' then return 'terminal' end
-- Queued: no worker owns it. A job that never ran gets no event log (its record is the
-- result; the final event is only published); one whose crashed attempt left events gets
-- its final event after them (at the next index), carrying their text.
local events = redis.call('XRANGE', out, '-', '+')
local idx, parts = 0, {}
for _, e in ipairs(events) do
  idx = tonumber(string.match(e[1], '%-(%d+)$'))
  local f = e[2]
  for i = 1, #f, 2 do if f[i] == 'd' then parts[#parts + 1] = f[i + 1] end end
end
local text = table.concat(parts)
local now = now_str()
write_final(#events > 0 and out or nil, ARGV[3], idx, 'cancelled', 'cancelled', text, '',
            0, 0)
local h = redis.call('HMGET', job, 'model', 'lane')
if h[1] and h[1] ~= '' then
  local ml = h[1] .. ':' .. (h[2] or 'interactive')  -- no lane: entered without SUBMIT
  leave_queue(job, ARGV[4] .. ml, ARGV[5] .. ml)
end
redis.call('HSET', job, 'status', 'cancelled', 'finish_reason', 'cancelled',
           'finished_at', now, 'text', text)
count_in_batch(job, 'cancelled')
redis.call('SREM', cset, ARGV[1])
redis.call('EXPIRE', job, ARGV[2])
redis.call('EXPIRE', out, ARGV[2])
return 'cancelled'
