-- REJECT (worker): a stream entry that cannot become a job (undecodable, invalid, poison,
-- refused by the engine): dead-letter it (body truncated by the caller; entries older
-- than the DLQ's retention trimmed by MINID, the key expires when idle), fail its job
-- record if it has a usable one that is not terminal yet (a queued one leaves the queue
-- counters), and ack + delete the entry.
-- KEYS: 1 jobs stream, 2 dlq stream, 3 job hash, 4 out stream, 5 queued-tokens,
--       6 queued-jobs counters
-- ARGV: 1 group, 2 entry_id, 3 reason, 4 job_id-or-'', 5 body, 6 now, 7 ttl, 8 channel,
--       9 deliveries, 10 dlq retention seconds
local _, t = now_str()
local min_id = (tonumber(t[1]) - tonumber(ARGV[10])) * 1000
redis.call('XADD', KEYS[2], 'MINID', '~', tostring(math.max(min_id, 0)), '*', 'entry', ARGV[2],
           'job', ARGV[4], 'reason', ARGV[3], 'body', ARGV[5], 'deliveries', ARGV[9],
           'at', ARGV[6])
redis.call('EXPIRE', KEYS[2], ARGV[10])
if ARGV[4] ~= '' then
  -- a hostile producer may have left any type at the job key: never let it stop the ack
  local ok, st = pcall(redis.call, 'HGET', KEYS[3], 'status')
  if ok and not TERMINAL[st or ''] then
    if st == 'queued' then leave_queue(KEYS[3], KEYS[5], KEYS[6]) end
    if redis.call('TYPE', KEYS[4])['ok'] ~= 'stream' then redis.call('DEL', KEYS[4]) end
    local idx = last_index(KEYS[4]) + 1
    redis.call('HSET', KEYS[3], 'status', 'failed', 'finish_reason', 'error',
               'error', ARGV[3], 'finished_at', ARGV[6])
    count_in_batch(KEYS[3], 'failed')
    write_final(KEYS[4], ARGV[8], idx, 'failed', 'error', '', ARGV[3], 0, 0)
    redis.call('EXPIRE', KEYS[3], ARGV[7])
    redis.call('EXPIRE', KEYS[4], ARGV[7])
  end
end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
return 'ok'
