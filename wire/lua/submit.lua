-- SUBMIT: enqueue one job, atomically and idempotently (docs/protocol.md "Submitting").
-- KEYS: 1 job hash, 2 jobs stream of the lane, 3 queued-tokens counter of the lane,
--       4 out stream, 5 queued-jobs counter of the lane, 6 serving zset of the model,
--       7 models set; only for a job of a bulk batch: 8 batch hash, 9 batch done list
-- ARGV: 1 job id, 2 body JSON, 3 req_hash, 4 model, 5 qtok, 6 timeout_s or "",
--       7 max_queued_jobs (0 = unlimited), 8 max_queued_tokens (0 = unlimited),
--       9 consumer group name, 10 schema version, 11 require_worker ("1" or "0"),
--       12 lane; only with KEYS 8-9: 13 batch item (pushed on the done list as it ends)
-- Reply: {"queued", entry_id} | {"exists", status} | {"conflict", ""}
--        | {"overloaded", cap_name, cap, current} | {"invalid", reason} | {"no_worker", model}
local job, stream, qkey, out = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
-- The script checks its own arguments: a producer in any language may call it, and a bad
-- argument must be refused here, not leave a job that no worker can run or count.
local id, model, lane = ARGV[1], ARGV[4], ARGV[12] or ''
local batch = #KEYS >= 9
local function bad(reason) return {'invalid', reason} end
if #id < 1 or #id > 128 or string.find(id, '^[%w_.:%-]+$') == nil then
  return bad('job id must be 1-128 of [A-Za-z0-9_.:-]')
end
if #model < 1 or #model > 128 or string.find(model, '^[%w_.%-]+$') == nil then
  return bad('model must be 1-128 of [A-Za-z0-9_.-]')
end
if #lane < 1 or #lane > 32 or string.find(lane, '^[a-z0-9_%-]+$') == nil then
  return bad('lane must be 1-32 of [a-z0-9_-]')
end
local function ends(s, suffix) return string.sub(s, -#suffix) == suffix end
local ml = model .. ':' .. lane
if not (ends(job, '}:job:' .. id) and ends(out, '}:out:' .. id) and ends(stream, '}:jobs:' .. ml)
        and ends(qkey, '}:qtokens:' .. ml) and ends(KEYS[5], '}:qjobs:' .. ml)
        and ends(KEYS[6], '}:serving:' .. model) and ends(KEYS[7], '}:models')) then
  return bad('KEYS do not name this job id, model and lane (see docs/protocol.md)')
end
if batch then
  local bid = string.match(KEYS[8], '}:batch:([%w_.:%-]+)$')
  if not bid or not ends(KEYS[9], '}:batchdone:' .. bid) or (ARGV[13] or '') == '' then
    return bad('KEYS 8-9 must name one batch and ARGV[13] its item (see docs/protocol.md)')
  end
end
for _, i in ipairs({5, 7, 8}) do
  if string.find(ARGV[i], '^%d+$') == nil or #ARGV[i] > 15 then
    return bad('ARGV[' .. i .. '] must be a non-negative integer')
  end
end
if ARGV[6] ~= '' and not (tonumber(ARGV[6]) and tonumber(ARGV[6]) > 0) then
  return bad('timeout_s must be empty or a positive number')
end
if ARGV[9] ~= 'workers' then return bad('consumer group must be "workers"') end
if ARGV[10] ~= '1' then return bad('schema version must be 1') end
if string.find(ARGV[3], '^%x+$') == nil or #ARGV[3] ~= 64 then
  return bad('req_hash must be the hex SHA-256 of the body')
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
if ARGV[11] == '1' and redis.call('ZCOUNT', KEYS[6], t[1], '+inf') == 0 then
  return {'no_worker', model}  -- serving scores are heartbeat expiry times
end
-- id 0: a group created after jobs were added still delivers them (BUSYGROUP ignored).
redis.pcall('XGROUP', 'CREATE', stream, ARGV[9], '0', 'MKSTREAM')
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
  deadline = string.format('%.6f', tonumber(t[1]) + tonumber(t[2]) / 1e6 + tonumber(ARGV[6]))
end
-- A job id reused after its record expired starts with an empty event log.
redis.call('DEL', out)
redis.call('HSET', job, 'status', 'queued', 'model', model, 'lane', lane, 'attempt', '0',
           'created_at', now, 'req_hash', ARGV[3], 'qtok', ARGV[5], 'deadline', deadline)
if batch then redis.call('HSET', job, 'bkey', KEYS[8], 'bdone', KEYS[9], 'bitem', ARGV[13]) end
-- queued = jobs submitted and not yet out of 'queued': see leave_queue (common.lua)
redis.call('INCRBY', qkey, qtok)
redis.call('INCR', KEYS[5])
redis.call('SADD', KEYS[7], model)
local eid = redis.call('XADD', stream, '*', 'job', id, 'body', ARGV[2], 'v', ARGV[10])
redis.call('HSET', job, 'entry', eid)
return {'queued', eid}
