"""Property tests of the wire contract through a real redis-server and a real worker process
(SmolLM2 on the CPU): every documented JobRequest field (guided specs, logit_bias, tools
included), valid and invalid, raw entries and raw script calls. After each example the
queue counters return to zero and their invariant (wire/invariants.py) holds."""
from __future__ import annotations

import hashlib
import json
import re
import time
import uuid

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedq.producer import Client
from pagedq.wire.errors import InvalidRequest
from pagedq.wire.invariants import queue_counters
from pagedq.wire.keys import GROUP, LANE_RE, Keys
from pagedq.wire.lua import source
from pagedq.wire.schema import FinalEvent, JobRequest, TokenEvent
from pagedq.wire.scripts import Submit
from pagedq.wire.tools import calls_of, mode
from tests.worker_proc import WorkerProc

SUBMIT_LUA = source("submit")

MODEL = "smollm2"
LANES = ("interactive", "batch")
VOCAB = 49152
PROPS = settings(max_examples=6, deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.function_scoped_fixture,
                                        HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def svc(shared_redis_server):
    prefix = f"prop{uuid.uuid4().hex[:8]}"
    w = WorkerProc(shared_redis_server.url, prefix, extra=["--max-num-seqs", "16"],
                   env={"PAGEDQ_UNSERVED_TIMEOUT_S": "0"}).start()
    c = Client(shared_redis_server.url, prefix=prefix, model=MODEL)
    c.url = shared_redis_server.url
    yield c, w
    w.stop()
    c.close()


def settle(c: Client, timeout: float = 120.0) -> None:
    """Wait until every lane is drained, then check the counters and their invariant."""
    for lane in LANES:
        deadline = time.monotonic() + timeout
        stream = c.keys.jobs(MODEL, lane)
        while time.monotonic() < deadline:
            snap = queue_counters(c.redis, c.keys, MODEL, lane)
            pending = c.redis.xpending(stream, GROUP)["pending"]
            if snap.queued_jobs == 0 and pending == 0 and c.redis.xlen(stream) == 0 \
                    and c.redis.llen(c.keys.inbox(MODEL, lane)) == 0:
                break
            time.sleep(0.1)
        snap = queue_counters(c.redis, c.keys, MODEL, lane)
        assert snap.ok and snap.queued_jobs == 0 and snap.queued_tokens == 0, (lane, snap)


# ---- valid requests: every field -----------------------------------------------------

text = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=40).filter(
    lambda s: s.strip())
part_list = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}),
                     min_size=1, max_size=2)
message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant",
                                                          "developer"]),
                                 "content": st.one_of(text, part_list)})
prompt_or_messages = st.one_of(
    st.fixed_dictionaries({"prompt": text}),
    st.fixed_dictionaries({"prompt": st.lists(st.integers(0, VOCAB - 1), min_size=1,
                                              max_size=12)}),
    st.fixed_dictionaries({"messages": st.lists(message, min_size=1, max_size=3).map(
        lambda ms: ms[:-1] + [{"role": "user", "content": "Say something."}])}),
)
optional = {
    "temperature": st.floats(0.0, 2.0),
    "top_p": st.floats(0.05, 1.0),
    "top_k": st.integers(-1, 50),
    "min_p": st.floats(0.0, 0.3),
    "repetition_penalty": st.floats(0.8, 1.5),
    "presence_penalty": st.floats(-2.0, 2.0),
    "frequency_penalty": st.floats(-2.0, 2.0),
    "stop": st.one_of(st.lists(text, max_size=2), text),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3),
    "seed": st.integers(0, 2**63 - 1),
    "ignore_eos": st.booleans(),
    "priority": st.integers(-1000, 1000),
    "lane": st.sampled_from(LANES),
    "timeout_s": st.floats(120.0, 600.0),
    "metadata": st.dictionaries(st.text(min_size=1, max_size=8).filter(str.isprintable),
                                st.text(max_size=8).filter(str.isprintable), max_size=3),
    "n": st.integers(1, 3),
    "user": st.text(min_size=1, max_size=8).filter(str.isprintable),
    "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.floats(-100, 100),
                                  max_size=3),
}
# guided specs small enough to end within a few tokens, and what a whole output of each is
GUIDED = {
    "regex": ({"regex": "[a-c]{1,4}"}, lambda t: re.fullmatch("[a-c]{1,4}", t)),
    "choice": ({"choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
    "grammar": ({"grammar": 'start: "x" | "y" NUM\nNUM: /[0-9]/'}, lambda t: re.fullmatch(
        "x|y[0-9]", t)),
    "json_object": ({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
    "json_schema": ({"json_schema": {"enum": [1, 22]}}, lambda t: json.loads(t) in (1, 22)),
}
TOOL = {"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "properties": {"k": {"enum": [1, 2]}}, "required": ["k"]}}}
TOOL_CHOICES = ["none", "auto", "required", {"type": "function", "function": {"name": "pick"}}]


@st.composite
def requests(draw) -> dict:
    body = dict(draw(prompt_or_messages))
    max_tokens = draw(st.integers(1, 6))
    body["max_completion_tokens" if draw(st.booleans()) else "max_tokens"] = max_tokens
    for name, strat in optional.items():
        if draw(st.booleans()):
            body[name] = draw(strat)
    if draw(st.booleans()):
        body["min_tokens"] = draw(st.integers(0, max_tokens))
    lp = draw(st.sampled_from(["none", "int", "chat"]))
    if lp == "int":
        body["logprobs"] = draw(st.integers(0, 5))
    elif lp == "chat":
        body["logprobs"] = True
        body["top_logprobs"] = draw(st.integers(0, 5))
    choice = draw(st.sampled_from([None, *TOOL_CHOICES])) if "messages" in body else None
    if choice is not None:
        body.update(tools=[TOOL], tool_choice=choice)
        if draw(st.booleans()):
            body["parallel_tool_calls"] = draw(st.booleans())
    kind = draw(st.sampled_from([None, *GUIDED]))
    if kind is not None and (choice != "auto" or kind.startswith("json")):
        if kind == "json_object" and draw(st.booleans()):  # OpenAI's name of it
            body["response_format"] = {"type": "json_object"}
        else:
            body["guided"] = GUIDED[kind][0]
    return body


def check_output(req: JobRequest, texts: dict[int, str], reasons: dict[int, str],
                 body: dict) -> None:
    """A choice the grammar ended (stop, no stop strings to cut it) matches its spec."""
    kind = next((k for k, (v, _) in GUIDED.items() if v == req.guided.to_wire()), None) \
        if req.guided is not None else None
    tools_on = mode(req.tools, req.tool_choice) not in (None, "auto")
    for k, text in texts.items():
        if reasons[k] != "stop" or req.stop:
            continue
        if tools_on:
            assert calls_of(text) and all(n == "pick" for n, _ in calls_of(text)), (body, text)
        elif kind is not None and not (req.tools and req.tool_choice != "none"
                                       and text.startswith("[")):
            assert GUIDED[kind][1](text), (body, text)


def check_job(c: Client, job_id: str, body: dict) -> None:
    req = JobRequest.model_validate(body)
    rec = c.result(job_id, timeout=120)
    assert rec.status == "finished", (rec, body)
    evs = list(c.stream(job_id, timeout=30))
    assert [e.index for e in evs] == list(range(len(evs)))
    final = evs[-1]
    assert isinstance(final, FinalEvent) and final.text == rec.text
    tokens = [e for e in evs if isinstance(e, TokenEvent)]
    texts = {k: "".join(e.delta for e in tokens if e.choice == k) for k in range(req.n)}
    counts = {k: sum(len(e.token_ids) for e in tokens if e.choice == k) for k in range(req.n)}
    assert texts[0] == rec.text
    assert sum(counts.values()) == rec.usage.completion_tokens
    assert rec.usage.prompt_tokens > 0
    assert all(1 <= counts[k] <= req.max_tokens for k in range(req.n)), counts
    enders = [e for e in tokens if e.finish_reason]
    assert sorted(e.choice for e in enders) == list(range(req.n))  # each choice ends once
    reasons = ({ch.index: ch.finish_reason for ch in rec.choices} if req.n > 1
               else {0: rec.finish_reason})
    check_output(req, texts, reasons, body)
    if req.n > 1:
        assert [ch.index for ch in rec.choices] == list(range(req.n))
        assert [ch.text for ch in rec.choices] == [texts[k] for k in range(req.n)]
        assert [ch.completion_tokens for ch in rec.choices] == [counts[k] for k in range(req.n)]
    else:
        assert rec.choices is None
    for e in tokens:
        if req.logprobs is None:
            assert e.logprobs is None
        else:
            assert e.logprobs is not None and len(e.logprobs) == len(e.token_ids)
            for lp, tid in zip(e.logprobs, e.token_ids, strict=True):
                assert lp.id == tid and lp.logprob <= 0 and lp.rank >= 1
                assert len(lp.top) == req.logprobs
                assert all(a.logprob >= b.logprob for a, b in zip(lp.top, lp.top[1:], strict=False))


@PROPS
@given(bodies=st.lists(requests(), min_size=1, max_size=5))
def test_random_valid_requests_end_to_end(svc, bodies):
    c, w = svc
    ids = [c.submit_request(dict(b)) for b in bodies]
    for job_id, body in zip(ids, bodies, strict=True):
        check_job(c, job_id, body)
    settle(c)
    assert w.proc.poll() is None, w.log()


# ---- invalid input: raw entries and raw script calls ---------------------------------

def submit_keys(k: Keys, job_id: str, model: str, lane: str) -> list[str]:
    """SUBMIT's KEYS (docs/protocol.md)."""
    return [k.job(job_id), k.inbox(model, lane), k.queued_tokens(model, lane), k.out(job_id),
            k.queued_jobs(model, lane), k.serving(model), k.models, k.wake(model)]


def raw_submit(c: Client, job_id: str, body: str | bytes, *, qtok="10", model=MODEL,
               timeout="", maxj="0", maxt="0", group=GROUP, version="1", lane="interactive",
               keys=None, batch=(), req_hash=None, require="0"):
    body_b = body.encode() if isinstance(body, str) else body
    kl = lane if LANE_RE.match(lane) else "interactive"  # keys of a lane that can exist
    k = keys or submit_keys(c.keys, job_id, model, kl)
    return c.redis.eval(SUBMIT_LUA, len(k) + len(batch) - bool(batch), *k, *batch[:-1], job_id,
                        body_b, req_hash or hashlib.sha1(body_b).hexdigest(), model, qtok,
                        timeout, maxj, maxt, group, version, require, lane, *batch[-1:])


def good_body(job_id: str, **kw) -> str:
    return json.dumps({"id": job_id, "model": MODEL, "prompt": "Hi", "max_tokens": 2, **kw})


BAD_WORKER_BODIES = {  # the submit script takes them (it checks only what it can): the
    # worker must dead-letter each with a reason
    "latin1": lambda j: b'{"prompt":"caf\xe9","max_tokens":4}',
    "string number": lambda j: good_body(j, max_tokens="4"),
    "bool as int": lambda j: good_body(j, top_k=True),
    "unknown field": lambda j: good_body(j, bogus=1),
    "no prompt": lambda j: json.dumps({"id": j, "max_tokens": 2}),
    "bad n": lambda j: good_body(j, n=0),
    "huge token id": lambda j: json.dumps({"id": j, "prompt": [VOCAB + 5], "max_tokens": 2}),
    # specs that cannot compile (the client's check at submit, skipped): the engine's refusal
    "bad schema": lambda j: good_body(j, guided={"json_schema": {"type": "objekt"}}),
    "bad regex": lambda j: good_body(j, guided={"regex": "a("}),
    "bad tool": lambda j: good_body(j, prompt=None, messages=[{"role": "user", "content": "x"}],
                                    tool_choice="required", tools=[{"type": "function",
                                    "function": {"name": "f", "parameters": {"type": "x"}}}]),
    "logit_bias id past the vocabulary": lambda j: good_body(j, logit_bias={str(VOCAB): 1}),
}
BAD_ENTRIES = {  # XADDed directly, bypassing the script
    "no body": lambda j: {"job": j},
    "bad id": lambda j: {"job": "a{b}", "body": good_body(j)},
    "nested too deep": lambda j: {"job": j, "body": '{"prompt": "x", "metadata": ' + "[" * 5000
                                  + "]" * 5000 + "}"},
    "bytes": lambda j: {"job": j, "body": b"\xff\xfe\x00garbage"},
    "not json": lambda j: {"job": j, "body": "{not json"},
    "json list": lambda j: {"job": j, "body": "[1, 2]"},
    "body id differs": lambda j: {"job": j, "body": good_body("other")},
    "model differs": lambda j: {"job": j, "body": good_body(j).replace(MODEL, "other-model")},
    "job id not utf8": lambda j: {"job": b"\xc3\x28", "body": good_body(j)},
    "lone surrogate escape": lambda j: {"job": j, "body": good_body(j, prompt="\ud800")},
    "lane differs": lambda j: {"job": j, "body": good_body(j, lane="batch")},
    "unknown schema version": lambda j: {"job": j, "body": good_body(j), "v": "2"},
}
BAD_SCRIPT_ARGS = {
    "qtok not a number": dict(qtok="abc"),
    "negative qtok": dict(qtok="-50"),
    "fraction qtok": dict(qtok="1.5"),
    "negative cap": dict(maxt="-1"),
    "bad timeout": dict(timeout="soon"),
    "zero timeout": dict(timeout="0"),
    "bad group": dict(group="other"),
    "bad version": dict(version="2"),
    "model differs from body": dict(model="other-model"),
    "lone surrogate escape": dict(body=lambda j: good_body(j, prompt="\ud800")),
    "body not an object": dict(body=lambda j: "[1]"),
    "bad lane": dict(lane="Not A Lane"),
    "lane differs from body": dict(body=lambda j: good_body(j, lane="batch")),
    "lane differs from keys": dict(lane="batch", keys_lane="interactive"),
    "batch keys of two batches": dict(batch=("{p}:batch:b1", "{p}:batchdone:b2", "item")),
    "batch without item": dict(batch=("{p}:batch:b1", "{p}:batchdone:b1", "")),
    "req_hash not the body's": dict(req_hash="0" * 40),
    "req_hash a SHA-256": dict(req_hash="0" * 64),
    "timeout past a week": dict(timeout="604801"),
    "require_worker not 0 or 1": dict(require="2"),
    "keys of another prefix": dict(keys_prefix="other"),
    "keys of another partition": dict(keys_prefix=1),
}


@PROPS
@given(data=st.data())
def test_random_invalid_input_is_refused_or_dead_lettered(svc, data):
    c, w = svc
    tag = uuid.uuid4().hex[:8]  # in every job id (and body) of this example
    good = [c.submit("Hello there", max_tokens=3, temperature=0) for _ in range(2)]
    worker_bad = data.draw(st.lists(st.sampled_from(sorted(BAD_WORKER_BODIES)), max_size=3))
    entry_bad = data.draw(st.lists(st.sampled_from(sorted(BAD_ENTRIES)), max_size=3))
    arg_bad = data.draw(st.lists(st.sampled_from(sorted(BAD_SCRIPT_ARGS)), max_size=3))
    bad_id_chars = data.draw(st.sampled_from(["a{b", "a b", "", "x" * 129, "é"]))
    failed: list[str] = []
    for name in worker_bad:
        j = f"wb-{tag}-{uuid.uuid4().hex[:8]}"
        assert raw_submit(c, j, BAD_WORKER_BODIES[name](j))[0] == "queued", name
        failed.append(j)
    for name in entry_bad:
        j = f"eb-{tag}-{uuid.uuid4().hex[:8]}"
        c.redis.xadd(c.keys.jobs(MODEL), BAD_ENTRIES[name](j))
        if name not in ("bad id", "job id not utf8"):
            failed.append(j)
    for name in arg_bad:
        j = f"ab-{tag}-{uuid.uuid4().hex[:8]}"
        kw = dict(BAD_SCRIPT_ARGS[name])
        body = kw.pop("body", good_body)(j)
        if "keys_lane" in kw:
            kw["keys"] = submit_keys(c.keys, j, MODEL, kw.pop("keys_lane"))
        if "keys_prefix" in kw:  # every key but the job's of another key space
            p = kw.pop("keys_prefix")
            other = c.keys.part(p) if isinstance(p, int) else Keys(p)
            kw["keys"] = submit_keys(c.keys, j, MODEL, "interactive")[:1] + submit_keys(
                other, j, MODEL, "interactive")[1:]
        reply = raw_submit(c, j, body, **kw)
        assert reply[0] == "invalid" and reply[1], (name, reply)
        assert not c.redis.exists(c.keys.job(j))
    reply = raw_submit(c, bad_id_chars, good_body("x"))
    assert reply[0] == "invalid"
    j = f"ab-{tag}"
    wrong_keys = [c.keys.job("other"), *submit_keys(c.keys, j, MODEL, "interactive")[1:]]
    assert raw_submit(c, j, good_body(j), keys=wrong_keys)[0] == "invalid"
    with redis.Redis.from_url(c.url) as raw:  # refused calls enqueued nothing
        entries = raw.xrange(c.keys.jobs(MODEL)) + raw.lrange(c.keys.inbox(MODEL), 0, -1)
    assert not [e for e in entries if b"ab-" + tag.encode() in str(e).encode()]
    for j in good:
        assert c.result(j, timeout=120).status == "finished"
    for j in failed:
        rec = c.result(j, timeout=120)
        assert rec.status == "failed" and rec.error, rec
        evs = list(c.stream(j, timeout=30))
        assert isinstance(evs[-1], FinalEvent) and evs[-1].error == rec.error
    settle(c)
    with redis.Redis.from_url(c.url) as raw:  # DLQ bodies are kept byte for byte
        dlq = [(i, f) for i, f in raw.xrange(c.keys.dlq(MODEL), count=100000)
               if tag.encode() in f[b"job"] + f[b"body"]]
    assert len(dlq) == len(worker_bad) + len(entry_bad), [f for _, f in dlq]
    assert all(f.get(b"reason") and len(f.get(b"body", b"")) <= 4 * 4096 for _, f in dlq)
    assert not dlq or c.redis.ttl(c.keys.dlq(MODEL)) > 0
    assert w.proc.poll() is None, w.log()


def test_jobs_of_a_batch_count_themselves_on_its_record_as_they_end(svc):
    c, w = svc
    bid, gone = f"b{uuid.uuid4().hex[:8]}", f"g{uuid.uuid4().hex[:8]}"
    c.redis.hset(c.keys.batch(bid), "total", 3)  # the batch control plane's record
    ok = [f"{bid}.{i}" for i in range(2)]
    for j in ok:
        keys, args = Submit(c.keys, JobRequest(id=j, model=MODEL, prompt="Hi", max_tokens=2,
                                               lane="batch"), c.settings,
                            batch=(bid, j)).keys_args()
        assert c.redis.eval(SUBMIT_LUA, len(keys), *keys, *args)[0] == "queued"
    bad = f"{bid}.bad"  # reaches the worker, which dead-letters it: failed
    keys, args = Submit(c.keys, JobRequest(id=bad, model=MODEL, prompt="Hi", lane="batch"),
                        c.settings, batch=(bid, bad)).keys_args()
    args[1] = good_body(bad, bogus=1, lane="batch")
    args[2] = hashlib.sha1(args[1].encode()).hexdigest()
    assert c.redis.eval(SUBMIT_LUA, len(keys), *keys, *args)[0] == "queued"
    orphan = f"{gone}.0"  # of a batch whose record is gone (expired): no stub is left
    keys, args = Submit(c.keys, JobRequest(id=orphan, model=MODEL, prompt="Hi", max_tokens=2,
                                           lane="batch"), c.settings,
                        batch=(gone, orphan)).keys_args()
    assert c.redis.eval(SUBMIT_LUA, len(keys), *keys, *args)[0] == "queued"
    assert [c.result(j, timeout=120).status for j in ok + [bad]] == ["finished"] * 2 + ["failed"]
    assert c.result(orphan, timeout=120).status == "finished"
    assert c.cancel(ok[0]) is False  # a second end is no end: counted once
    rec = c.redis.hgetall(c.keys.batch(bid))
    assert rec == {"total": "3", "completed": "2", "failed": "1", "n_finished": "2",
                   "n_failed": "1"}, rec
    assert sorted(c.redis.lrange(c.keys.batch_done(bid), 0, -1)) == sorted(ok + [bad])
    assert not c.redis.exists(c.keys.batch(gone), c.keys.batch_done(gone))
    settle(c)


def test_client_refuses_what_the_wire_refuses(svc):
    c, _ = svc
    for kw in [dict(prompt="caf\udce9"), dict(prompt="x", max_tokens="4"), dict(prompt="x", n=0),
               dict(prompt="x", top_logprobs=3), dict(messages=[{"role": "user",
                                                                 "content": [{"type": "image"}]}]),
               dict(prompt="x", guided={"regex": "a("}), dict(prompt="x", guided="json"),
               dict(prompt="x", logit_bias={"1": 101}), dict(prompt="x", tools=[TOOL]),
               dict(prompt="x", response_format={"type": "json_schema"})]:
        with pytest.raises(InvalidRequest):
            c.submit_request(kw)


def test_worker_survives_a_wrong_type_at_a_job_key(svc):
    c, w = svc
    j = f"wt-{uuid.uuid4().hex[:8]}"
    c.redis.set(c.keys.job(j), "not a hash")
    c.redis.xadd(c.keys.jobs(MODEL), {"job": j, "body": good_body(j)})
    ok = c.submit("Hello", max_tokens=2)
    assert c.result(ok, timeout=120).status == "finished"
    settle(c)
    assert w.proc.poll() is None, w.log()
    with pytest.raises(redis.ResponseError):
        c.redis.hgetall(c.keys.job(j))
