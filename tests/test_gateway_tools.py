"""Structured output and tool calling through the gateway: `pagedq gateway` as a real
process, a real redis-server, a real SmolLM2 worker and rq worker; driven by the official
`openai` SDK (response_format, tools and tool_choice, a tool-call round trip, streamed
tool-call deltas, logit_bias and logprobs), httpx for a resumed stream of tool-call deltas,
LangChain's ChatOpenAI (with_structured_output, bind_tools) and a batch file."""
from __future__ import annotations

import contextlib
import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from pagedq.producer import Client
from pagedq.wire.invariants import queue_counters
from pagedq.wire.settings import Settings
from pagedq.worker.redis_server import RedisServer
from tests.test_batch_e2e import RqWorker
from tests.test_gateway import PREFIX, Gateway, job_of, make_key, sse_events
from tests.waiting import until
from tests.worker_proc import WorkerProc

MODEL = "smollm2"
PERSON = {"type": "object", "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 20}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)


@contextlib.contextmanager
def smollm2_gateway(batch_dir):
    """redis-server, a SmolLM2 worker, `pagedq gateway` and an rq worker (batches) ->
    (the Redis URL, the gateway); all stopped after."""
    srv = RedisServer().start()
    w = WorkerProc(srv.url, PREFIX, extra=["--max-num-seqs", "16"]).start(wait=False)
    gw = Gateway(srv.url, batch_dir, model=MODEL)
    rq = None
    try:
        gw.wait_ready()
        w.wait_ready()
        rq = RqWorker(srv.url, batch_dir).start()
        yield srv.url, gw
    finally:
        if rq is not None:
            rq.stop()
        assert gw.stop() == 0, gw.log()
        w.stop(10)
        srv.cleanup()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with smollm2_gateway(tmp_path_factory.mktemp("gw-tools")) as (url, gw):
        class Stack:
            gateway = gw
            key = make_key(url, "--name", "tools")
            pq = Client(settings=Settings(redis_url=url, prefix=PREFIX, model=MODEL))
            sdk = openai.OpenAI(base_url=gw.base + "/v1", api_key=key, max_retries=0)

        yield Stack()
        Stack.pq.close()


def create(stack, **kw):
    kw.setdefault("temperature", 0)
    return stack.sdk.chat.completions.create(model=MODEL, **kw)


def test_response_format_json_object_and_json_schema(stack):
    for rf, check in [
        ({"type": "json_object"}, lambda v: isinstance(v, dict)),
        ({"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                 "strict": True}},
         lambda v: jsonschema.validate(v, PERSON) is None and set(v) == {"name", "age"}),
    ]:
        msgs = [{"role": "user", "content": "Describe a cat as JSON with its name and age."}]
        r = create(stack, messages=msgs, response_format=rf, max_tokens=40)
        ch = r.choices[0]
        assert ch.finish_reason == "stop" and check(json.loads(ch.message.content)), ch
        chunks = list(create(stack, messages=msgs, response_format=rf, max_tokens=40,
                             stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == ch.message.content
        assert chunks[-1].choices[0].finish_reason == "stop"
    # the SDK's own structured output: a pydantic model as a strict json_schema, parsed back
    parsed = stack.sdk.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Invent a person."}],
        response_format=Person, max_tokens=40, temperature=0).choices[0].message.parsed
    assert isinstance(parsed, Person) and parsed.name


def test_a_tool_call_round_trip(stack):
    r = create(stack, messages=ASK, tools=[WEATHER], tool_choice="required",
               parallel_tool_calls=False, max_tokens=40)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    (call,) = ch.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_") and set(json.loads(call.function.arguments)) == {"city"}
    back = ASK + [ch.message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": "sunny, 25 C"}]
    answer = create(stack, messages=back, tools=[WEATHER], tool_choice="none", max_tokens=24)
    a = answer.choices[0]
    assert a.message.tool_calls is None and a.message.content and a.finish_reason in (
        "stop", "length")
    # streamed, the same round trip: the call's deltas, then the answer's text
    chunks = list(create(stack, messages=ASK, tools=[WEATHER], tool_choice="required",
                         parallel_tool_calls=False, max_tokens=40, stream=True))
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and deltas[0].type
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in deltas[1:])
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments
    assert not any(c.choices[0].delta.content for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    text = "".join(c.choices[0].delta.content or "" for c in create(
        stack, messages=back, tools=[WEATHER], tool_choice="none", max_tokens=24, stream=True))
    assert text == a.message.content


def test_auto_answers_text_or_calls_and_the_sdk_stream_helper_reads_calls(stack):
    r = create(stack, messages=ASK, tools=[WEATHER], max_tokens=40)  # tool_choice auto
    ch = r.choices[0]
    if ch.message.tool_calls:
        assert ch.finish_reason == "tool_calls" and ch.message.content is None
    else:
        assert ch.message.content and not ch.message.content.startswith("[")
    with stack.sdk.chat.completions.stream(model=MODEL, messages=ASK, tools=[WEATHER],
                                           tool_choice=NAMED, max_tokens=40,
                                           temperature=0) as s:
        done = [e for e in s if e.type == "tool_calls.function.arguments.done"]
        final = s.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert [e.arguments for e in done] == [call.function.arguments]
    assert json.loads(call.function.arguments)["city"]


def test_a_resumed_stream_of_tool_call_deltas_continues_them(stack):
    """The tool-call deltas of event k depend on the events before it (the call's head):
    a stream resumed there (Last-Event-ID) renders exactly what the whole stream did."""
    body = {"model": MODEL, "messages": ASK, "tools": [WEATHER], "tool_choice": "required",
            "max_tokens": 40, "temperature": 0, "stream": True,
            "pagedq": {"job_id": "tools-resume"}}
    headers = {"Authorization": f"Bearer {stack.key}"}
    url = stack.gateway.base + "/v1/chat/completions"
    with httpx.stream("POST", url, json=body, headers=headers, timeout=120) as resp:
        whole = list(sse_events(resp.iter_lines()))
    with_args = [i for i, (_, d) in enumerate(whole) if '"arguments":' in d]
    assert len(with_args) > 3
    for cut in (with_args[0], with_args[len(with_args) // 2]):
        with httpx.stream("POST", url, json=body, timeout=120,
                          headers={**headers, "Last-Event-ID": whole[cut][0]}) as resp:
            assert list(sse_events(resp.iter_lines())) == whole[cut + 1:]


def test_bad_specs_are_400_and_nothing_is_queued(stack):
    bad_param = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}
    cases = [
        (dict(messages=ASK, response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "objekt"}}}), "response_format", "objekt"),
        (dict(messages=ASK, tools=[bad_param], tool_choice="required"), "tools", "strin"),
        (dict(messages=ASK, tools=[WEATHER], tool_choice={
            "type": "function", "function": {"name": "nope"}}), None, "'nope'"),
        (dict(messages=ASK, response_format={"type": "xml"}), None, "response_format must be"),
        (dict(messages=ASK, logit_bias={"abc": 1}), "logit_bias.abc", "valid integer"),
    ]
    for kw, param, words in cases:
        with pytest.raises(openai.BadRequestError) as err:
            create(stack, max_tokens=4, **kw)
        e = err.value.body
        assert words in e["message"] and e["param"] == param and e["code"] == "invalid_request", e
    with pytest.raises(openai.BadRequestError, match="suffix: a suffix") as err:
        stack.sdk.completions.create(model=MODEL, prompt="Hi", suffix="!", logprobs=1)
    assert err.value.param == "suffix"
    snap = queue_counters(stack.pq.redis, stack.pq.keys, MODEL, "interactive")
    assert snap.ok and snap.queued_jobs == 0
    assert stack.pq.redis.xlen(stack.pq.keys.jobs(MODEL)) == 0


def test_logit_bias_and_logprobs_in_openai_shapes(stack):
    q = [{"role": "user", "content": "What is the capital of France?"}]
    base = create(stack, messages=q, max_tokens=3, logprobs=True, top_logprobs=2)
    lp = base.choices[0].logprobs.content
    assert len(lp) == base.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in lp)
    first = stack.pq.stream  # the first token's id, from the job's event log
    ids = [t for e in first(job_of(base.id), timeout=30) if e.type == "token"
           for t in e.token_ids]
    banned = create(stack, messages=q, max_tokens=3, logprobs=True,
                    logit_bias={str(ids[0]): -100})
    assert banned.choices[0].logprobs.content[0].token != lp[0].token
    c = stack.sdk.completions.create(model=MODEL, prompt="The capital of France is",
                                     max_tokens=3, temperature=0, logprobs=2,
                                     logit_bias={str(ids[0]): 5})
    assert len(c.choices[0].logprobs.tokens) == 3 and len(c.choices[0].logprobs.top_logprobs[0]) == 2


def test_langchain_structured_output_and_tools(stack):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=stack.gateway.base + "/v1", api_key=stack.key,
                     temperature=0, max_tokens=40, max_retries=0)
    for method in ("json_schema", "function_calling"):
        p = llm.with_structured_output(Person, method=method).invoke("Invent a person.")
        assert isinstance(p, Person) and p.name, (method, p)

    @tool
    def get_weather(city: str) -> str:
        """The current weather of a city."""
        return f"sunny in {city}, 25 C"

    ask = [HumanMessage("What is the weather in Paris?")]
    # "any" = OpenAI's "required"; one call (SmolLM2, free to add calls, repeats its first)
    ai = llm.bind_tools([get_weather], tool_choice="any", parallel_tool_calls=False).invoke(ask)
    (call,) = ai.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"] and call["id"]
    result = get_weather.invoke(call["args"])
    answer = llm.invoke(ask + [ai, ToolMessage(result, tool_call_id=call["id"])])
    assert answer.content and not answer.tool_calls


def test_a_batch_file_with_response_format_and_tools(stack, tmp_path):
    chat = "/v1/chat/completions"
    bodies = {
        "schema": {"messages": [{"role": "user", "content": "Invent a person."}],
                   "response_format": {"type": "json_schema", "json_schema": {
                       "name": "person", "schema": PERSON}}},
        "tool": {"messages": ASK, "tools": [WEATHER], "tool_choice": NAMED},
        "bad": {"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "objekt"}}}},
    }
    c = stack.sdk
    b, rows = run_batch(c, tmp_path, chat, {k: {"max_tokens": 40, "temperature": 0, **x}
                                            for k, x in bodies.items()})
    assert b.status == "completed" and b.request_counts.completed == 2, b
    person = rows["schema"]["response"]["body"]["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(person), PERSON)
    choice = rows["tool"]["response"]["body"]["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"])["city"]
    (err,) = map(json.loads, c.files.content(b.error_file_id).text.splitlines())
    assert err["custom_id"] == "bad" and "Invalid type: objekt" in err["error"]["message"]


def run_batch(sdk: openai.OpenAI, folder, url: str, bodies: dict[str, dict]):
    """Upload a batch of ``bodies`` (custom_id -> body, the model added) to ``url``, wait
    for its end -> (the batch, its output rows by custom_id)."""
    src = folder / "in.jsonl"
    src.write_text("".join(json.dumps({"custom_id": k, "method": "POST", "url": url,
                                       "body": {"model": MODEL, **b}}) + "\n"
                           for k, b in bodies.items()))
    f = sdk.files.create(file=src.open("rb"), purpose="batch")
    b = sdk.batches.create(input_file_id=f.id, endpoint=url, completion_window="24h")
    b = until(lambda: (x := sdk.batches.retrieve(b.id)).status in (
        "completed", "failed", "expired", "cancelled") and x, "the batch ended", 180, 0.2)
    out = sdk.files.content(b.output_file_id).text.splitlines() if b.output_file_id else []
    return b, {r["custom_id"]: r for r in map(json.loads, out)}
