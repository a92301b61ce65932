"""Guided decoding, logit_bias and tools through the queue: real redis-server, real worker
processes, the Python client and the `pagedq submit` command. The bundled SmolLM2 for real
text (50 JSON-schema jobs beside unguided ones, every guided kind, tool calls, bad specs
refused at submit or failed by the worker); the tiny random Llama for a guided job resumed
after a kill -9."""
from __future__ import annotations

import contextlib
import io
import json
import re
import uuid

import jsonschema
import pytest

from pagedq.cli import main as pagedq_main
from pagedq.producer import Client
from pagedq.wire import script
from pagedq.wire.errors import InvalidRequest
from pagedq.wire.invariants import queue_counters
from pagedq.wire.keys import GROUP
from pagedq.wire.schema import JobRequest, TokenEvent
from pagedq.wire.scripts import Submit
from pagedq.wire.tools import calls_of
from tests.worker_proc import WorkerProc

MODEL = "smollm2"
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "color"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "color": {"enum": ["red", "green", "blue"]}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 20}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time of a city",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 20}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def smol(shared_redis_server):
    prefix = f"gs{uuid.uuid4().hex[:8]}"
    w = WorkerProc(shared_redis_server.url, prefix, extra=["--max-num-seqs", "64"]).start()
    c = Client(shared_redis_server.url, prefix=prefix, model=MODEL)
    c.url = shared_redis_server.url
    yield c, w
    w.stop()
    c.close()


def outputs(c: Client, ids: list[str]) -> list[dict]:
    """Per job: its record and its token ids (from its event log)."""
    out = []
    for j in ids:
        rec = c.result(j, timeout=300)
        toks = [t for e in c.stream(j, timeout=60) if isinstance(e, TokenEvent)
                for t in e.token_ids]
        out.append({"rec": rec, "ids": toks})
    return out


def test_fifty_json_schema_jobs_validate_beside_unchanged_unguided_jobs(smol):
    c, w = smol
    plain = [dict(messages=chat(q), max_tokens=12, temperature=0.0 if i < 2 else 0.8, seed=i)
             for i, q in enumerate(["What is the capital of France?", "Name three fruits.",
                                    "Write a haiku about rain.", "Why is the sky blue?"])]
    guided = [dict(messages=chat(f"Invent person number {i} and describe them as JSON."),
                   max_tokens=40, temperature=0.0 if i % 2 else 0.7, seed=100 + i,
                   guided={"json_schema": PERSON}) for i in range(50)]
    alone = outputs(c, c.submit_many(plain))
    mixed = outputs(c, c.submit_many(guided[:25] + plain[:2] + guided[25:] + plain[2:]))
    got = mixed[:25] + mixed[27:52]
    for o in got:
        assert o["rec"].status == "finished" and o["rec"].finish_reason == "stop", o["rec"]
        jsonschema.validate(json.loads(o["rec"].text), PERSON)
    assert len({o["rec"].text for o in got[::2]}) > 5  # sampled rows differ
    for a, m in zip(alone, mixed[25:27] + mixed[52:], strict=True):
        assert (m["rec"].text, m["ids"]) == (a["rec"].text, a["ids"])  # unchanged by them
    assert w.proc.poll() is None


def test_every_guided_kind_logit_bias_and_tools_end_to_end(smol):
    c, _ = smol
    lark = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,3}/'
    first = outputs(c, [c.submit(messages=chat("What is the capital of France?"),
                                 max_tokens=3, temperature=0.0)])[0]["ids"][0]
    jobs = {
        "regex": c.submit(messages=chat("Give me a phone number."), max_tokens=20,
                          temperature=0.0, guided={"regex": r"\(\d{3}\) \d{3}-\d{4}"}),
        "choice": c.submit(messages=chat("Which animal barks?"), max_tokens=8, n=2,
                           temperature=0.9, seed=3, guided={"choice": ["cat", "dog", "bird"]}),
        "lark": c.submit(messages=chat("How many legs does a spider have?"), max_tokens=16,
                         temperature=0.0, guided={"grammar": lark}),
        "object": c.submit(messages=chat("Describe a cat as a JSON object with its name and age."), max_tokens=40,
                           temperature=0.0, response_format={"type": "json_object"}),
        "schema": c.submit(messages=chat("Invent a person."), max_tokens=40, temperature=0.0,
                           response_format={"type": "json_schema", "json_schema": {
                               "name": "person", "schema": PERSON, "strict": True}}),
        "prompt": c.submit("A person as JSON:", max_tokens=40, temperature=0.0,
                           guided={"json_schema": PERSON}),
        "bias": c.submit(messages=chat("What is the capital of France?"), max_tokens=3,
                         temperature=0.0, logit_bias={str(first): -100}),
        "named": c.submit(messages=ASK, tools=[WEATHER, TIME], max_tokens=40, temperature=0.0,
                          tool_choice={"type": "function", "function": {"name": "get_time"}}),
        "required": c.submit(messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                             parallel_tool_calls=False, max_tokens=40, temperature=0.0),
        "auto": c.submit(messages=ASK, tools=[WEATHER], max_tokens=40, temperature=0.0),
        "none": c.submit(messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=12,
                         temperature=0.0),
        "no tools": c.submit(messages=ASK, max_tokens=12, temperature=0.0),
    }
    rec = {k: c.result(j, timeout=300) for k, j in jobs.items()}
    assert all(r.status == "finished" for r in rec.values()), rec
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", rec["regex"].text)
    assert [ch.text in ("cat", "dog", "bird") for ch in rec["choice"].choices] == [True, True]
    assert re.fullmatch(r"The answer is [0-9]{1,3}\.", rec["lark"].text)
    assert isinstance(json.loads(rec["object"].text), dict)
    for k in ("schema", "prompt"):
        jsonschema.validate(json.loads(rec[k].text), PERSON)
    assert outputs(c, [jobs["bias"]])[0]["ids"][0] != first  # the greedy first token, banned
    (name, args), = calls_of(rec["named"].text)
    assert name == "get_time" and set(json.loads(args)) == {"city"}
    (name, args), = calls_of(rec["required"].text)
    assert name in ("get_weather", "get_time") and json.loads(args)["city"]
    assert all(rec[k].finish_reason == "stop" for k in ("named", "required"))
    # auto: text, or a call (complete, when the grammar ended it), as the model chose
    auto = rec["auto"].text
    assert auto and (rec["auto"].finish_reason == "length" or not auto.startswith("[")
                     or calls_of(auto)), rec["auto"]
    assert rec["none"].text == rec["no tools"].text  # none: no tools in the prompt, no grammar
    # the tool result sent back: the model answers it in text
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Paris"}'}}
    back = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 25 C"}]
    answer = c.result(c.submit(messages=back, tools=[WEATHER], tool_choice="none",
                               max_tokens=24, temperature=0.0), timeout=300)
    assert answer.status == "finished" and answer.text and not answer.text.startswith("[")


def nothing_queued(c: Client) -> bool:
    snap = queue_counters(c.redis, c.keys, MODEL, "interactive")
    return snap.ok and snap.queued_jobs == 0 and c.redis.xlen(c.keys.jobs(MODEL)) == 0


@pytest.mark.parametrize("kw,message", [
    (dict(guided={"json_schema": {"type": "objekt"}}), "guided json_schema: Invalid type: objekt"),
    (dict(guided={"regex": "a("}), "guided regex: .*unclosed group"),
    (dict(guided={"grammar": "start: foo"}), 'guided grammar: .*unknown name: "foo"'),
    (dict(guided={"choice": []}), "guided: choice: text must be a JSON array"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     "response_format.json_schema must be"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}], tool_choice="required"),
     r"tools.0.function.parameters \(f\): Invalid type: strin"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice names the function 'nope'"),
    (dict(tools=[WEATHER], guided={"regex": "a+"}), "guided regex cannot be combined"),
    (dict(logit_bias={"x": 1}), r"logit_bias\.x: Input should be a valid integer"),
])
def test_a_bad_spec_is_refused_at_submit_nothing_queued(smol, kw, message):
    c, _ = smol
    with pytest.raises(InvalidRequest, match=message) as err:
        c.submit(messages=ASK, **kw)
    assert "\n" not in str(err.value) and nothing_queued(c)


def test_the_worker_fails_a_bad_spec_per_job_and_goes_on(smol):
    """A producer that skips the compile check (another language, an old client): the
    worker's engine refuses the spec at add_request; the job fails with the reason (and is
    dead-lettered), the others beside it run."""
    c, w = smol
    bad = {"schema": dict(messages=ASK, guided={"json_schema": {"type": "objekt"}}),
           "tool": dict(messages=ASK, tool_choice="required", tools=[{
               "type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}])}
    ids = {}
    for name, body in bad.items():
        req = JobRequest.model_validate({**body, "id": f"bad-{name}-{uuid.uuid4().hex[:6]}",
                                         "model": MODEL, "max_tokens": 8})
        ids[name] = script.run(c.redis, Submit(c.keys, req, c.settings))  # no compile check
    good = c.submit(messages=ASK, max_tokens=4, guided={"regex": "[a-z]{2,6}"})
    for name, j in ids.items():
        rec = c.result(j, timeout=300)
        assert rec.status == "failed" and "Invalid type: objekt" in rec.error, (name, rec)
    assert re.fullmatch("[a-z]{2,6}", c.result(good, timeout=300).text)
    dlq = [f for _, f in c.redis.xrange(c.keys.dlq(MODEL))]
    assert {f["job"] for f in dlq} >= set(ids.values())
    assert c.redis.xpending(c.keys.jobs(MODEL), GROUP)["pending"] == 0 and w.proc.poll() is None


def pagedq(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = pagedq_main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_submit_command_guided_options(smol, tmp_path):
    c, _ = smol
    root = ["--redis-url", c.url, "--prefix", c.keys.prefix, "submit", "--chat", "--wait",
            "--timeout", "120", "--temperature", "0", "--model", MODEL]
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    grammar = tmp_path / "yes.gbnf"
    grammar.write_text('root ::= ("yes" | "no") "."')
    code, out, err = pagedq(*root, "Invent a person.", "--json-schema", str(schema),
                            "--max-tokens", "40")
    assert code == 0, err
    jsonschema.validate(json.loads(out), PERSON)
    for opts, check in [(["--regex", "[0-9]{3}"], r"[0-9]{3}"),
                        (["--json-object"], r"\{.*"),  # (24 tokens may cut it short)
                        (["--choice", "red", "--choice", "blue"], r"red|blue"),
                        (["--grammar", str(grammar)], r"(yes|no)\."),
                        (["--logit-bias", "28=-100", "--regex", "[a-z]{2,4}"], r"[a-z]{2,4}")]:
        code, out, err = pagedq(*root, "Answer me.", "--max-tokens", "24", *opts)
        assert code == 0 and re.fullmatch(check, out.strip(), re.S), (opts, out, err)
    bad_schema = tmp_path / "bad.json"
    bad_schema.write_text('{"type": "objekt"}')
    for opts, message in [(["--json-schema", str(tmp_path / "none.json")],
                           "--json-schema .*none.json: cannot read it"),
                          (["--json-schema", str(grammar)], "--json-schema .*: not JSON"),
                          (["--json-schema", str(bad_schema)], "Invalid type: objekt"),
                          (["--logit-bias", "abc"], "--logit-bias 'abc': expected TOKEN_ID=BIAS"),
                          (["--logit-bias", "5=500"], "logit_bias.5: Input should be less"),
                          (["--regex", "a("], "guided regex: .*unclosed group")]:
        code, out, err = pagedq(*root, "Hi", *opts)
        assert code == 2 and re.match(f"pagedq: .*{message}", err) and err.count("\n") == 1, \
            (opts, err)
    code, _, err = pagedq(*root, "Hi", "--regex", "a", "--json-object")
    assert code == 2 and "not allowed with argument" in err
    assert nothing_queued(c)


def test_a_guided_job_resumed_after_kill9_continues_its_document(svc):
    """The tiny model (fast steps, slowed to 50 ms): a seeded JSON-schema job killed
    mid-document resumes on a second worker, which replays the streamed tokens through the
    grammar; its output is valid, without repeated or missing tokens, and equal to the same
    job run uninterrupted."""
    schema = {"type": "object", "required": ["a", "b", "c"],
              "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99999},
                             "b": {"type": "string", "minLength": 8, "maxLength": 12},
                             "c": {"enum": ["xx", "yyy"]}}}
    a = svc.worker(env={"PAGEDQ_FAILPOINTS": "step_sleep_s=0.05"})
    c = svc.client()
    body = dict(prompt="resume me", max_tokens=60, temperature=0.9, seed=77,
                guided={"json_schema": schema})
    job = c.submit(**body)
    it = c.stream(job, timeout=60)
    for _ in range(6):
        assert next(it).type == "token"
    a.kill()
    svc.worker()
    rec = c.result(job, timeout=120)
    evs = list(c.stream(job, timeout=60))
    assert [e.index for e in evs] == list(range(len(evs)))
    assert rec.status == "finished" and rec.attempt == 2 and rec.finish_reason == "stop", rec
    assert "".join(e.delta for e in evs[:-1]) == rec.text
    jsonschema.validate(json.loads(rec.text), schema)
    ref = c.result(c.submit(**body), timeout=120)  # uninterrupted
    assert ref.text == rec.text
