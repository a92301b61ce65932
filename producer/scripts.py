"""The producer's side of the wire: the Lua scripts it runs (their KEYS/ARGV contract and
reply decoding) and request preparation, shared by Client and AsyncClient.

Both clients (sync and asyncio) call these scripts through redis-py ``Script`` objects
(EVALSHA with a NOSCRIPT fallback). A non-Python producer must EVAL the same text with
the same KEYS/ARGV; docs/protocol.md restates the contract.

All KEYS share the ``{prefix}`` hash tag (producer/keys.py), so each script touches one
Redis Cluster slot. CANCEL derives the queued-tokens key from the job's stored model
(``ARGV[4] .. model``); it is in the same slot as the declared keys.
"""
from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from .errors import InvalidRequest, JobConflict, JobNotFound, NoWorker, Overloaded
from .keys import GROUP, Keys, check_job_id
from .schema import SCHEMA_VERSION, JobRequest, describe
from .settings import Settings

# KEYS: 1 job hash, 2 jobs stream, 3 queued-tokens counter, 4 out stream,
#       5 queued-jobs counter, 6 serving zset of the model, 7 models set
# ARGV: 1 job id, 2 body JSON, 3 req_hash, 4 model, 5 qtok, 6 timeout_s or "",
#       7 max_queued_jobs (0 = unlimited), 8 max_queued_tokens (0 = unlimited),
#       9 consumer group name, 10 schema version, 11 require_worker ("1" or "0")
# Reply: {"queued", entry_id} | {"exists", status} | {"conflict", ""}
#        | {"overloaded", cap_name, cap, current} | {"invalid", reason} | {"no_worker", model}
SUBMIT_LUA = r"""
local job, stream, qkey, out = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
-- The script checks its own arguments: a producer in any language may call it, and a bad
-- argument must be refused here, not leave a job that no worker can run or count.
local id, model = ARGV[1], ARGV[4]
local function bad(reason) return {'invalid', reason} end
if #id < 1 or #id > 128 or string.find(id, '^[%w_.:%-]+$') == nil then
  return bad('job id must be 1-128 of [A-Za-z0-9_.:-]')
end
if #model < 1 or #model > 128 or string.find(model, '^[%w_.%-]+$') == nil then
  return bad('model must be 1-128 of [A-Za-z0-9_.-]')
end
local function ends(s, suffix) return string.sub(s, -#suffix) == suffix end
if not (ends(job, '}:job:' .. id) and ends(out, '}:out:' .. id) and ends(stream, '}:jobs:' .. model)
        and ends(qkey, '}:qtokens:' .. model) and ends(KEYS[5], '}:qjobs:' .. model)
        and ends(KEYS[6], '}:serving:' .. model) and ends(KEYS[7], '}:models')) then
  return bad('KEYS do not name this job id and model (see docs/protocol.md)')
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
if redis.call('EXISTS', job) == 1 then
  if redis.call('HGET', job, 'req_hash') == ARGV[3] then
    return {'exists', redis.call('HGET', job, 'status') or ''}
  end
  return {'conflict', ''}
end
local t = redis.call('TIME')
if ARGV[11] == '1' and redis.call('ZCOUNT', KEYS[6], t[1], '+inf') == 0 then
  return {'no_worker', model}  -- serving scores are heartbeat expiry times
end
-- queued = jobs submitted and not yet started/cancelled: an exact counter kept by whoever
-- moves a job out of 'queued' (worker START, CANCEL, REJECT, expiry), atomically with the
-- status change.
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
local now = t[1] .. '.' .. string.format('%06d', tonumber(t[2]))
local deadline = ''
if ARGV[6] ~= '' then
  deadline = string.format('%.6f', tonumber(t[1]) + tonumber(t[2]) / 1e6 + tonumber(ARGV[6]))
end
-- A job id reused after its record expired starts with an empty event log.
redis.call('DEL', out)
redis.call('HSET', job, 'status', 'queued', 'model', model, 'attempt', '0',
           'created_at', now, 'req_hash', ARGV[3], 'qtok', ARGV[5], 'deadline', deadline)
redis.call('INCRBY', qkey, qtok)
redis.call('INCR', KEYS[5])
redis.call('SADD', KEYS[7], model)
local eid = redis.call('XADD', stream, '*', 'job', id, 'body', ARGV[2], 'v', ARGV[10])
redis.call('HSET', job, 'entry', eid)
return {'queued', eid}
"""

# KEYS: 1 job hash, 2 out stream, 3 cancel set
# ARGV: 1 job id, 2 result_ttl_s, 3 pub/sub channel, 4 queued-tokens key prefix (model appended),
#       5 queued-jobs key prefix (model appended)
# Reply: "missing" | "terminal" | "cancelled" (was queued) | "requested" (was running)
CANCEL_LUA = r"""
local job, out, cset = KEYS[1], KEYS[2], KEYS[3]
local st = redis.call('HGET', job, 'status')
if not st then return 'missing' end
if st == 'running' then
  redis.call('SADD', cset, ARGV[1])
  return 'requested'
end
if st ~= 'queued' then return 'terminal' end
-- Queued: no worker owns it. The final event goes after any events a previous, crashed
-- attempt left (normally none: index 0) and carries their text.
local idx, parts = 0, {}
for _, e in ipairs(redis.call('XRANGE', out, '-', '+')) do
  idx = tonumber(string.match(e[1], '%-(%d+)$'))
  local f = e[2]
  for i = 1, #f, 2 do if f[i] == 'd' then parts[#parts + 1] = f[i + 1] end end
end
local text = table.concat(parts)
local t = redis.call('TIME')
local now = t[1] .. '.' .. string.format('%06d', tonumber(t[2]))
local ev = {'t', 'final', 'i', tostring(idx), 'status', 'cancelled', 'fr', 'cancelled',
            'text', text, 'err', '', 'pt', '0', 'ct', '0'}
redis.call('XADD', out, '0-' .. (idx + 1), unpack(ev))
local msg = {}
for i = 1, #ev, 2 do msg[ev[i]] = ev[i + 1] end
redis.call('PUBLISH', ARGV[3], cjson.encode(msg))
-- Whoever takes a job out of the queued state (worker start, cancel, expiry) subtracts its
-- qtok from the counter and zeroes the field in the same atomic step: never twice.
local qtok = tonumber(redis.call('HGET', job, 'qtok') or '0') or 0
local model = redis.call('HGET', job, 'model') or ''
if qtok > 0 and model ~= '' then
  local qkey = ARGV[4] .. model
  if redis.call('DECRBY', qkey, qtok) < 0 then redis.call('SET', qkey, '0') end
end
if model ~= '' and redis.call('HGET', job, 'raw') ~= '1' then
  local jkey = ARGV[5] .. model
  if redis.call('DECR', jkey) < 0 then redis.call('SET', jkey, '0') end
end
redis.call('HSET', job, 'status', 'cancelled', 'finish_reason', 'cancelled',
           'finished_at', now, 'text', text, 'qtok', '0')
redis.call('SREM', cset, ARGV[1])
redis.call('EXPIRE', job, ARGV[2])
redis.call('EXPIRE', out, ARGV[2])
return 'cancelled'
"""


# Models with live workers. KEYS: models set   ARGV: key base '{P}'
# -> {model, live worker count, ...} for every model of the set
SERVED_LUA = r"""
local t = redis.call('TIME')
local out = {}
for _, m in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  out[#out + 1] = m
  out[#out + 1] = redis.call('ZCOUNT', ARGV[1] .. ':serving:' .. m, t[1], '+inf')
end
return out
"""


@dataclass(frozen=True, slots=True)
class Scripts:
    submit: Any  # redis.commands.core.Script or AsyncScript
    cancel: Any
    served: Any


def register(r: Any) -> Scripts:
    """Register the scripts on a sync or asyncio redis client (no round trip)."""
    return Scripts(submit=r.register_script(SUBMIT_LUA), cancel=r.register_script(CANCEL_LUA),
                   served=r.register_script(SERVED_LUA))


def served_call(keys: Keys) -> tuple[list[str], list[str]]:
    return [keys.models], [keys.base]


def served_reply(reply: Any) -> dict[str, int]:
    pairs = list(reply or [])
    return {_s(m): int(n) for m, n in zip(pairs[::2], pairs[1::2], strict=True) if int(n) > 0}


def req_hash(body: str) -> str:
    return hashlib.sha256(body.encode()).hexdigest()


def queued_tokens_of(req: JobRequest) -> int:
    """The backpressure weight of a job: prompt chars / 4 (rough tokens) + max_tokens."""
    if isinstance(req.prompt, list):
        return len(req.prompt) + req.max_tokens
    chars = len(req.prompt) if req.prompt is not None else sum(
        len(m.content) for m in req.messages or [])
    return chars // 4 + req.max_tokens


def submit_call(keys: Keys, req: JobRequest, settings: Settings,
                require_worker: bool = False) -> tuple[list[str], list[str]]:
    """KEYS and ARGV of SUBMIT_LUA for a validated request that has an id."""
    if req.id is None:
        raise ValueError("submit_call needs a request with an id")
    body = req.body_json()
    return (
        [keys.job(req.id), keys.jobs(req.model), keys.queued_tokens(req.model), keys.out(req.id),
         keys.queued_jobs(req.model), keys.serving(req.model), keys.models],
        [req.id, body, req_hash(body), req.model, str(queued_tokens_of(req)),
         "" if req.timeout_s is None else str(float(req.timeout_s)),
         str(settings.max_queued_jobs), str(settings.max_queued_tokens), GROUP,
         str(SCHEMA_VERSION), "1" if require_worker else "0"],
    )


def check_submit_reply(reply: Any, job_id: str) -> str:
    """Return the job id, or raise the typed error the script's reply stands for."""
    kind = _s(reply[0])
    if kind in ("queued", "exists"):
        return job_id
    if kind == "conflict":
        raise JobConflict(f"job id {job_id!r} already exists with a different request body")
    if kind == "overloaded":
        cap, limit, cur = (_s(x) for x in reply[1:4])
        raise Overloaded(f"queue is full: {cap}={limit} (currently {cur}); retry later")
    if kind == "invalid":
        raise InvalidRequest(f"submit refused: {_s(reply[1])}")
    if kind == "no_worker":
        raise NoWorker(f"no live worker serves model {_s(reply[1])!r}; nothing was enqueued")
    raise RuntimeError(f"unexpected submit script reply {reply!r}")


def cancel_call(keys: Keys, job_id: str, settings: Settings) -> tuple[list[str], list[str]]:
    return ([keys.job(job_id), keys.out(job_id), keys.cancel],
            [job_id, str(settings.result_ttl_s), keys.chan(job_id), keys.queued_tokens(""),
             keys.queued_jobs("")])


def check_cancel_reply(reply: Any, job_id: str) -> bool:
    kind = _s(reply)
    if kind == "missing":
        raise JobNotFound(job_id)
    return kind in ("cancelled", "requested")


def _s(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


# ---- request preparation (shared by Client and AsyncClient)

def validate_request(data: dict[str, Any] | JobRequest) -> JobRequest:
    """Validate (again, if already a model: it may have been built unvalidated)."""
    if isinstance(data, JobRequest):
        data = data.model_dump(exclude_none=True)
    try:
        return JobRequest.model_validate(data)
    except ValidationError as e:
        raise InvalidRequest("invalid job request: " + describe(e)) from None


def build_request(prompt: str | list[int] | None, messages: list[Any] | None, model: str,
                  job_id: str | None, explicit: dict[str, Any],
                  params: dict[str, Any]) -> JobRequest:
    """``explicit`` are the named keyword arguments (None = the schema default); ``params``
    are passed through as given, so an unknown field is rejected rather than dropped."""
    data: dict[str, Any] = {k: v for k, v in explicit.items() if v is not None}
    data.update(params)
    if prompt is not None:
        data["prompt"] = prompt
    if messages is not None:
        data["messages"] = messages
    data["model"] = model
    data["id"] = job_id if job_id is not None else uuid.uuid4().hex
    return validate_request(data)


def with_id(req: JobRequest | dict[str, Any], default_model: str) -> JobRequest:
    """The request with an id (a new uuid4 hex if unset) and the client's model if the
    request did not name one, validated."""
    if isinstance(req, JobRequest):
        named_model = "model" in req.model_fields_set
        req = req.model_dump(exclude_none=True)
        if not named_model:
            req["model"] = default_model
    if not isinstance(req, dict):
        raise InvalidRequest(f"expected a JobRequest or a dict, got {type(req).__name__}")
    req = dict(req)
    req.setdefault("model", default_model)
    if req.get("id") is None:
        req["id"] = uuid.uuid4().hex
    return validate_request(req)


def checked_id(job_id: str) -> str:
    try:
        return check_job_id(job_id)
    except ValueError as e:
        raise InvalidRequest(str(e)) from None


def collect_replies(reqs: list[JobRequest], replies: list[Any]) -> list[str]:
    ids: list[str | None] = []
    first: Exception | None = None
    for req, reply in zip(reqs, replies, strict=True):
        try:
            if isinstance(reply, Exception):
                raise reply
            ids.append(check_submit_reply(reply, req.id))
        except Exception as e:  # re-raised below, after the bookkeeping
            ids.append(None)
            first = first or e
    if first is not None:
        first.job_ids = ids  # type: ignore[attr-defined]
        raise first
    return ids  # type: ignore[return-value]
