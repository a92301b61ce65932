-- MOVE (worker): jobs SUBMIT put on a lane's inbox, oldest first, into its jobs stream (as
-- entries 'job', 'body', 'v'), where workers read them with XREADGROUP. A job no longer
-- queued (cancelled while in the inbox) is dropped; an item without a record (pushed
-- without SUBMIT) goes in as it came, for the worker to judge, as any raw entry.
-- KEYS: 1 inbox list, 2 jobs stream   ARGV: 1 key base '{P}', 2 most items to move,
--       3 consumer group
-- Reply: {entries added, 1 if the stream (and its group) had to be made, else 0}
local made = 0
if redis.call('EXISTS', KEYS[2]) == 0 then
  -- id 0: the entries added next are delivered (and a stream that vanished, with its group,
  -- in a Redis that lost its data, is made again here)
  redis.call('XGROUP', 'CREATE', KEYS[2], ARGV[3], '0', 'MKSTREAM')
  made = 1
end
local items = redis.call('LPOP', KEYS[1], tonumber(ARGV[2]))
if not items then return {0, made} end
local n = 0
for _, item in ipairs(items) do
  local id, v, body = string.match(item, '^([^\n]*)\n([^\n]*)\n(.*)$')
  if not id then id, v, body = '', '', item end
  local st = false
  if valid_id(id) then
    local ok, s = pcall(redis.call, 'HGET', ARGV[1] .. ':job:' .. id, 'status')
    st = ok and s
  end
  if st == 'queued' or not st then
    local eid = redis.call('XADD', KEYS[2], '*', 'job', id, 'body', body, 'v', v)
    if st == 'queued' then redis.call('HSET', ARGV[1] .. ':job:' .. id, 'entry', eid) end
    n = n + 1
  end
end
return {n, made}
