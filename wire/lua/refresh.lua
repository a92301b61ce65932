-- REFRESH (worker): reset the idle time of entries this worker still owns, so live
-- long-running jobs are not reclaimed. Fenced: an entry whose job attempt moved on
-- (reclaimed by another worker) is left alone, never claimed back.
-- KEYS: 1 jobs stream, 2.. job hashes   ARGV: 1 group, 2 consumer, then entry_id, attempt
-- per job
local n = 0
for j = 2, #KEYS do
  local b = 3 + 2 * (j - 2)
  local ok, attempt = pcall(redis.call, 'HGET', KEYS[j], 'attempt')
  if ok and attempt == ARGV[b + 1] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[b], 'JUSTID')
    n = n + 1
  end
end
return n
