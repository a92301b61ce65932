-- SUBMIT: enqueue one job, atomically and idempotently (docs/protocol.md "Submitting").
-- KEYS: 1 job hash, 2 inbox list of the lane, 3 queued-tokens counter of the lane,
--       4 out stream, 5 queued-jobs counter of the lane, 6 serving zset of the model,
--       7 models set, 8 wake list of the model; only for a job of a bulk batch: 9 batch
--       hash, 10 batch done list. Every key is of the key space (hash tag) of KEYS 1.
-- ARGV: 1 job id, 2 body JSON, 3 req_hash (hex SHA-1 of the body), 4 model, 5 qtok,
--       6 timeout_s or "", 7 max_queued_jobs (0 = unlimited), 8 max_queued_tokens
--       (0 = unlimited), 9 consumer group name, 10 schema version, 11 require_worker ("1"
--       or "0"), 12 lane; only with KEYS 9-10: 13 batch item (pushed on the done list as
--       it ends)
-- Reply: {"queued", ""} | {"exists", status} | {"conflict", ""}
--        | {"overloaded", cap_name, cap, current} | {"invalid", reason} | {"no_worker", model}
-- The job goes on the lane's inbox, never on its jobs stream: a worker moves it there
-- (MOVE), so that a producer needs no right on the streams (docs/security.md).
local job, inbox, qkey, out = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
-- The script checks its own arguments: a producer in any language may call it, and a bad
-- argument must be refused here, not leave a job that no worker can run or count.
local id, model, lane = ARGV[1] or '', ARGV[4] or '', ARGV[12] or ''
local batch = #KEYS == 10
local function bad(reason) return {'invalid', reason} end
if not ((#KEYS == 8 and #ARGV == 12) or (batch and #ARGV == 13)) then
  return bad('SUBMIT takes 8 KEYS and 12 ARGV, or 10 and 13 for a job of a batch')
end
if not valid_id(id) then return bad('job id must be 1-128 of [A-Za-z0-9_.:-]') end
if #model < 1 or #model > 128 or string.find(model, '^[%w_.%-]+$') == nil then
  return bad('model must be 1-128 of [A-Za-z0-9_.-]')
end
if #lane < 1 or #lane > 32 or string.find(lane, '^[a-z0-9_%-]+$') == nil then
  return bad('lane must be 1-32 of [a-z0-9_-]')
end
local base, ml = key_base(job), model .. ':' .. lane
local want = {base, ':job:' .. id, ':inbox:' .. ml, ':qtokens:' .. ml, ':out:' .. id,
              ':qjobs:' .. ml, ':serving:' .. model, ':models', ':wake:' .. model}
for i = 1, 8 do
  if not base or KEYS[i] ~= base .. want[i + 1] then
    return bad('KEYS[' .. i .. '] must be ' .. (base or '{P}') .. want[i + 1]
               .. ' (every key of one key space: see docs/protocol.md)')
  end
end
if batch then
  local head = base .. ':batch:'
  local bid = string.sub(KEYS[9], 1, #head) == head and string.sub(KEYS[9], #head + 1) or ''
  if not valid_id(bid) or KEYS[10] ~= base .. ':batchdone:' .. bid
     or ARGV[13] == '' then
    return bad('KEYS 9-10 must name one batch of the key space and ARGV[13] its item')
  end
end
for _, i in ipairs({5, 7, 8}) do
  if string.find(ARGV[i], '^%d+$') == nil or #ARGV[i] > 15 then
    return bad('ARGV[' .. i .. '] must be a non-negative integer')
  end
end
local timeout = tonumber(ARGV[6])
if ARGV[6] ~= '' and not (timeout and timeout > 0 and timeout <= 604800) then
  return bad('timeout_s must be empty or a number in (0, 604800]')
end
if ARGV[9] ~= 'workers' then return bad('consumer group must be "workers"') end
if ARGV[10] ~= '1' then return bad('schema version must be 1') end
if ARGV[11] ~= '0' and ARGV[11] ~= '1' then return bad('require_worker must be 0 or 1') end
if ARGV[3] ~= redis.sha1hex(ARGV[2]) then
  return bad('req_hash must be the lowercase hex SHA-1 of the body')
end
local ok, obj = pcall(cjson.decode, ARGV[2])
if not ok or type(obj) ~= 'table' or string.find(ARGV[2], '^%s*{') == nil then
  return bad('body must be a JSON object')
end
if obj.id ~= nil and obj.id ~= id then return bad('body id differs from the job id') end
if obj.model ~= nil and obj.model ~= model then return bad('body model differs from the model') end
if obj.lane ~= nil and obj.lane ~= lane then return bad('body lane differs from the lane') end
if redis.call('EXISTS', job) == 1 then
  if redis.call('HGET', job, 'req_hash') == ARGV[3] then
    return {'exists', redis.call('HGET', job, 'status') or ''}
  end
  return {'conflict', ''}
end
local now, t = now_str()
if ARGV[11] == '1' and live_count(KEYS[6]) == 0 then return {'no_worker', model} end
local queued = tonumber(redis.call('GET', KEYS[5]) or '0') or 0
local qtok, maxj, maxt = tonumber(ARGV[5]), tonumber(ARGV[7]), tonumber(ARGV[8])
if maxj > 0 and queued >= maxj then
  return {'overloaded', 'max_queued_jobs', tostring(maxj), tostring(queued)}
end
local cur = tonumber(redis.call('GET', qkey) or '0') or 0
-- A single job larger than the cap is admitted into an empty queue, else it never could be.
if maxt > 0 and cur > 0 and cur + qtok > maxt then
  return {'overloaded', 'max_queued_tokens', tostring(maxt), tostring(cur)}
end
local deadline = ''
if ARGV[6] ~= '' then
  deadline = string.format('%.6f', tonumber(t[1]) + tonumber(t[2]) / 1e6 + timeout)
end
-- The first write may grow memory: a full Redis (maxmemory) refuses it before anything is
-- written, whether it checks the call up front (a function) or its first write (EVAL).
redis.call('HSET', job, 'status', 'queued', 'model', model, 'lane', lane, 'attempt', '0',
           'created_at', now, 'req_hash', ARGV[3], 'qtok', ARGV[5], 'deadline', deadline)
-- A job id reused after its record expired starts with an empty event log.
redis.call('DEL', out)
if batch then redis.call('HSET', job, 'bkey', KEYS[9], 'bdone', KEYS[10], 'bitem', ARGV[13]) end
-- queued = jobs submitted and not yet out of 'queued': see leave_queue (common.lua)
redis.call('INCRBY', qkey, qtok)
redis.call('INCR', KEYS[5])
redis.call('SADD', KEYS[7], model)
redis.call('RPUSH', inbox, id .. '\n' .. ARGV[10] .. '\n' .. ARGV[2])
-- one doorbell per job for the idle workers (BLPOP); a few dozen are enough to wake them all
if redis.call('LLEN', KEYS[8]) < 64 then redis.call('RPUSH', KEYS[8], '1') end
return {'queued', ''}
