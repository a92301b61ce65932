-- FINISH (worker): the terminal record, the final event and the ack, in one step.
-- KEYS: 1 job hash, 2 out stream, 3 jobs stream, 4 cancel set
-- ARGV: 1 attempt, 2 status, 3 finish_reason, 4 text, 5 error, 6 prompt_tokens,
--       7 completion_tokens, 8 index, 9 ttl, 10 entry_id, 11 group, 12 job_id, 13 channel,
--       14 now, 15 maxlen, 16 choices-json-or-''
-- Reply: 'ok' | 'dup' (already terminal under our attempt: just acked) | 'fenced' (not ours)
--        | 'behind' (the log lacks token events before the final's index: nothing written;
--        its round failed in part, e.g. on a full Redis: the caller sends the round again)
local h = redis.call('HMGET', KEYS[1], 'attempt', 'status')
if h[1] ~= ARGV[1] then return 'fenced' end
local function ack()
  -- the entry is not needed once its job is terminal: keep the jobs stream bounded
  if ARGV[10] ~= '' then
    redis.call('XACK', KEYS[3], ARGV[11], ARGV[10])
    redis.call('XDEL', KEYS[3], ARGV[10])
  end
end
if TERMINAL[h[2]] then
  ack()
  return 'dup'
end
local last = last_index(KEYS[2])  -- -1: no log (never written, expired): nothing to check
if last >= 0 and last < tonumber(ARGV[8]) - 1 then return 'behind' end
local choices = ARGV[16] or ''
redis.call('HSET', KEYS[1], 'status', ARGV[2], 'finish_reason', ARGV[3], 'text', ARGV[4],
           'error', ARGV[5], 'prompt_tokens', ARGV[6], 'completion_tokens', ARGV[7],
           'finished_at', ARGV[14])
if choices ~= '' then redis.call('HSET', KEYS[1], 'choices', choices) end
count_in_batch(KEYS[1], ARGV[2])
write_final(KEYS[2], ARGV[13], ARGV[8], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7],
            choices, ARGV[15])
redis.call('EXPIRE', KEYS[1], ARGV[9])
redis.call('EXPIRE', KEYS[2], ARGV[9])
redis.call('SREM', KEYS[4], ARGV[12])
ack()
return 'ok'
