"""The gateway as the clients people use call it, through a real SmolLM2 worker (CPU,
float32), a real redis-server, `pagedq gateway` and an rq worker (batches):

* the exact request bodies guidellm and lm-eval send, recorded from their sources
  (vllm-project/guidellm at ee7a774, src/guidellm/backends/openai/request_handlers.py:
  TextCompletionsRequestHandler, ChatCompletionsRequestHandler, ResponsesRequestHandler
  ``format``; EleutherAI/lm-evaluation-harness at 4e7e0d4, lm_eval/models/
  openai_completions.py: LocalCompletionsAPI ``_create_payload``, ``parse_logprobs``,
  ``parse_generations``); neither tool is installed, their parsing is re-stated here;
* lm-eval's loglikelihood: the prompt logprobs the gateway returns equal transformers' own
  log-softmax of the same prompt within 1e-3;
* the Responses API through the official SDK's ``client.responses.create``: plain,
  streamed, function tools with a call-output round trip, text.format json_schema, stored
  responses and previous_response_id;
* OpenAI's request fields: ignored ones accepted, unserved ones a 400 naming them; echo;
  lists of prompts; x-request-id; the 404 of an unknown route; batches (echo, usage, the
  ids of invalid lines).
"""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
import torch

from pagedq.engine.loader import hf_folder, load_tokenizer, resolve_model
from pagedq.producer import Client
from pagedq.wire.settings import Settings
from tests.model_fixtures import load_hf
from tests.test_gateway import PREFIX, make_key
from tests.test_gateway_tools import run_batch, smollm2_gateway

pytestmark = pytest.mark.timeout(600)
MODEL = "smollm2"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather of a city",
           "parameters": {"type": "object", "required": ["city"], "additionalProperties": False,
                          "properties": {"city": {"type": "string", "maxLength": 20}}}}
PERSON = {"type": "object", "required": ["name", "age"], "additionalProperties": False,
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with smollm2_gateway(tmp_path_factory.mktemp("gw-compat")) as (url, gw):
        class Stack:
            gateway, base = gw, gw.base
            key = make_key(url, "--name", "compat")
            headers = {"Authorization": f"Bearer {key}"}
            pq = Client(settings=Settings(redis_url=url, prefix=PREFIX, model=MODEL))
            sdk = openai.OpenAI(base_url=gw.base + "/v1", api_key=key, max_retries=0)

            def post(self, path: str, body: dict, **kw) -> httpx.Response:
                return httpx.post(self.base + path, json=body, headers=self.headers,
                                  timeout=120, **kw)

            def sse(self, path: str, body: dict) -> list[tuple[str | None, str]]:
                """(event, data) of each SSE event of a streamed request."""
                out, event, data = [], None, []
                with httpx.stream("POST", self.base + path, json=body, headers=self.headers,
                                  timeout=120) as r:
                    assert r.status_code == 200, r.read()
                    for line in r.iter_lines():
                        if line == "":
                            if data:
                                out.append((event, "\n".join(data)))
                            event, data = None, []
                        elif line.startswith("event: "):
                            event = line[7:]
                        elif line.startswith("data: "):
                            data.append(line[6:])
                return out

        yield Stack()
        Stack.pq.close()


@pytest.fixture(scope="module")
def hf():
    """transformers' SmolLM2 on the weights the worker serves (float32) and its tokenizer."""
    folder = hf_folder(resolve_model(MODEL))
    return load_hf(folder), load_tokenizer(folder)


def chunks(events: list[tuple[str | None, str]]) -> list[dict]:
    assert events[-1][1] == "[DONE]"
    return [json.loads(d) for _, d in events[:-1]]


# ---------------------------------------------------------------- guidellm

def test_guidellm_streaming_completions_and_chat_bodies(stack):
    """guidellm's bodies with ``output_metrics.text_tokens`` = 12: usage in every chunk
    (vLLM's continuous_usage_stats), exactly 12 tokens (ignore_eos), stop null."""
    opts = {"include_usage": True, "continuous_usage_stats": True}
    completion = {"model": MODEL, "stream": True, "stream_options": opts, "max_tokens": 12,
                  "stop": None, "ignore_eos": True, "prompt": "The history of the printing press"}
    chat = {"model": MODEL, "stream": True, "stream_options": opts,
            "max_completion_tokens": 12, "stop": None, "ignore_eos": True,
            "messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "Hi there"}]}]}
    for path, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
        cs = chunks(stack.sse(path, body))
        last = cs[-1]
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 12
        prompt = last["usage"]["prompt_tokens"]
        assert prompt > 0 and all(c["usage"]["prompt_tokens"] == prompt for c in cs)
        done = [c["usage"]["completion_tokens"] for c in cs]
        assert done == sorted(done) and done[0] <= 1  # running totals
        assert all(c["usage"]["total_tokens"] == prompt + c["usage"]["completion_tokens"]
                   for c in cs)
        rec = stack.pq.status(cs[0]["id"].split("-", 1)[1])
        text = "".join(ch.get("text") or ch.get("delta", {}).get("content") or ""
                       for c in cs for ch in c["choices"])
        assert text == rec.text and rec.usage.completion_tokens == 12


def test_guidellm_responses_body(stack):
    body = {"model": MODEL, "stream": True, "max_output_tokens": 10, "stop": None,
            "ignore_eos": True, "instructions": "You are terse.",
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hello"}]}]}
    events = stack.sse("/v1/responses", body)
    kinds = [e for e, _ in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    datas = [json.loads(d) for _, d in events]
    assert [d["sequence_number"] for d in datas] == list(range(len(datas)))
    assert all(e == d["type"] for e, d in zip(kinds, datas, strict=True))
    done = datas[-1]["response"]
    text = "".join(d["delta"] for d in datas if d["type"] == "response.output_text.delta")
    assert done["status"] == "incomplete" and done["incomplete_details"] == {
        "reason": "max_output_tokens"}  # ignore_eos: cut by max_output_tokens
    assert done["usage"]["output_tokens"] == 10 and done["output"][0]["content"][0]["text"] == text


# ---------------------------------------------------------------- lm-eval

def lm_eval_loglikelihood(out: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-eval's LocalCompletionsAPI.parse_logprobs, re-stated."""
    res = []
    for choice, ctxlen in zip(sorted(out["choices"], key=lambda c: c["index"]), ctxlens,
                              strict=False):
        lps = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        res.append((sum(lps), all(t == max(top.values()) for t, top in zip(lps, tops,
                                                                          strict=False))))
    return res


def test_lm_eval_loglikelihood_equals_transformers(stack, hf):
    model, tok = hf
    pairs = [("The capital of France is", " Paris"), ("Two plus two equals", " four"),
             ("The sky is", " green with purple dots")]
    ctx = [tok.encode(c) for c, _ in pairs]
    prompts = [c + tok.encode(c_ + x)[len(c):] for c, (c_, x) in zip(ctx, pairs, strict=True)]
    # lm-eval's body for a batch of loglikelihood requests (--batch_size 3)
    body = {"model": MODEL, "prompt": prompts, "temperature": 0, "max_tokens": 1,
            "logprobs": 1, "seed": 1234, "echo": True}
    r = stack.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    got = lm_eval_loglikelihood(out, [len(c) for c in ctx])
    for (ll, greedy), ids, c, choice in zip(got, prompts, ctx, out["choices"], strict=True):
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
        want = [ref[p - 1, ids[p]].item() for p in range(1, len(ids))]
        lps = choice["logprobs"]["token_logprobs"]
        assert len(lps) == len(ids) + 1 and lps[0] is None  # the prompt, then 1 token
        assert max(abs(a - b) for a, b in zip(lps[1:len(ids)], want, strict=True)) < 1e-3
        assert abs(ll - sum(want[len(c) - 1:])) < 1e-3 * len(ids)
        assert greedy == all(ref[p - 1].argmax().item() == ids[p] for p in range(len(c),
                                                                                 len(ids)))
        assert choice["logprobs"]["top_logprobs"][0] is None
        assert choice["text"].startswith(tok.decode(ids[:1]))
    assert out["usage"]["prompt_tokens"] == sum(map(len, prompts))
    assert out["usage"]["completion_tokens"] == 3


def test_lm_eval_generate_until_body(stack, hf):
    _, tok = hf
    prompts = [tok.encode("Q: What is 2+3?\nA:"), tok.encode("Q: Name a color.\nA:")]
    body = {"prompt": prompts, "model": MODEL, "max_tokens": 16, "temperature": 0,
            "stop": ["\n\n", "Question:", "<|im_end|>"], "seed": 1234}
    out = stack.post("/v1/completions", body).json()
    # lm-eval's parse_generations: choices placed by index
    texts = [None] * len(out["choices"])
    for c in out["choices"]:
        texts[c["index"]] = c["text"]
    for ids, text in zip(prompts, texts, strict=True):  # each alone: the same greedy text
        alone = stack.sdk.completions.create(model=MODEL, prompt=ids, max_tokens=16,
                                             temperature=0, stop=body["stop"])
        assert alone.choices[0].text == text
    assert out["usage"]["completion_tokens"] > 0


# ---------------------------------------------------------------- completions: echo, lists

def test_echo_with_logprobs_and_max_tokens_0_or_more(stack):
    c = stack.sdk
    prompt = "Once upon a time there was"
    zero = c.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=0)
    ch = zero.choices[0]
    assert ch.text == prompt and ch.finish_reason == "length"
    n = zero.usage.prompt_tokens
    assert zero.usage.completion_tokens == 0 and len(ch.logprobs.tokens) == n
    assert "".join(ch.logprobs.tokens) == prompt
    assert ch.logprobs.token_logprobs[0] is None and ch.logprobs.top_logprobs[0] is None
    assert all(len(t) == 2 for t in ch.logprobs.top_logprobs[1:])
    assert ch.logprobs.text_offset[:2] == [0, len(ch.logprobs.tokens[0])]
    more = c.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=2,
                                max_tokens=4, temperature=0)
    m = more.choices[0]
    assert m.text.startswith(prompt) and len(m.logprobs.tokens) == n + 4
    assert m.logprobs.token_logprobs[0] is None and all(
        abs(a - b) < 1e-4 for a, b in zip(m.logprobs.token_logprobs[1:n],
                                          ch.logprobs.token_logprobs[1:], strict=True))
    plain = c.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    assert m.text == prompt + plain.choices[0].text  # echo changes nothing generated
    assert c.completions.create(model=MODEL, prompt=prompt, echo=True,
                                max_tokens=0).choices[0].logprobs is None
    streamed = list(c.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=2,
                                         max_tokens=4, temperature=0, stream=True))
    assert "".join(x.choices[0].text for x in streamed) == m.text
    toks = [t for x in streamed if x.choices[0].logprobs for t in x.choices[0].logprobs.tokens]
    offs = [o for x in streamed if x.choices[0].logprobs
            for o in x.choices[0].logprobs.text_offset]
    assert toks == m.logprobs.tokens and offs == m.logprobs.text_offset
    with pytest.raises(openai.BadRequestError) as e:  # nothing to generate, nothing to echo
        c.completions.create(model=MODEL, prompt=prompt, max_tokens=0)
    assert e.value.param == "max_tokens"


def test_a_list_of_prompts_is_a_job_each_indexed_as_openai(stack):
    c = stack.sdk
    prompts = ["Red, green and", "One, two,"]
    r = c.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=5, temperature=0,
                             extra_body={"pagedq": {"job_id": "many"}})
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3] and r.id == "cmpl-many-0"
    for i, p in enumerate(prompts):
        alone = c.completions.create(model=MODEL, prompt=p, n=2, max_tokens=5, temperature=0)
        assert [ch.text for ch in r.choices[2 * i:2 * i + 2]] == [
            ch.text for ch in alone.choices]
        assert stack.pq.status(f"many-{i}").usage == stack.pq.status(alone.id[5:]).usage
    recs = [stack.pq.status(f"many-{i}") for i in range(2)]
    assert r.usage.prompt_tokens == sum(x.usage.prompt_tokens for x in recs)
    assert r.usage.completion_tokens == sum(x.usage.completion_tokens for x in recs)
    streamed = list(c.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=5,
                                         temperature=0, stream=True,
                                         stream_options={"include_usage": True}))
    text: dict[int, str] = {}
    for x in streamed:
        for ch in x.choices:
            text[ch.index] = text.get(ch.index, "") + ch.text
    assert text == {ch.index: ch.text for ch in r.choices}
    assert streamed[-1].usage.completion_tokens == r.usage.completion_tokens
    assert len({x.id for x in streamed}) == 1
    ids = [[1, 2, 3], [4, 5]]  # token-id prompts, as lm-eval sends them
    assert len(c.completions.create(model=MODEL, prompt=ids, max_tokens=1).choices) == 2


# ---------------------------------------------------------------- OpenAI's fields

def test_fields_that_change_nothing_are_accepted_and_unserved_ones_named(stack):
    c = stack.sdk
    msgs = [{"role": "user", "content": "Say hi"}]
    base = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0)
    same = c.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=6, temperature=0, store=True,
        metadata={"team": "eval"}, service_tier="auto", reasoning_effort="low",
        prompt_cache_key="k1", safety_identifier="user-1", verbosity="low",
        modalities=["text"], stream_options=None, user="u1",
        prompt_cache_retention="24h")
    assert same.choices[0].message.content == base.choices[0].message.content
    streamed = list(c.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True, "include_obfuscation": True}))
    assert streamed[-1].usage.completion_tokens == base.usage.completion_tokens
    for kw, param in [(dict(modalities=["text", "audio"]), "modalities"),
                      (dict(audio={"voice": "alloy", "format": "wav"}), "audio"),
                      (dict(prediction={"type": "content", "content": "hi"}), "prediction"),
                      (dict(web_search_options={}), "web_search_options"),
                      (dict(extra_body={"moderation": {"model": "x"}}), "moderation")]:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, **kw)
        assert e.value.param == param, kw
    for kw, param in [(dict(best_of=3), "best_of"), (dict(suffix="end"), "suffix"),
                      (dict(extra_body={"prompt_logprobs": 1}), "prompt_logprobs")]:
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model=MODEL, prompt="hi", max_tokens=2, **kw)
        assert e.value.param == param, kw
    assert c.completions.create(model=MODEL, prompt="hi", max_tokens=2, best_of=1,
                                suffix="").choices


def test_request_ids_routes_and_models(stack):
    r = stack.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1})
    ok = r.headers["x-request-id"]
    assert r.status_code == 200 and ok.startswith("req_")
    bad = stack.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": -1})
    assert bad.status_code == 400 and bad.headers["x-request-id"] not in ("", ok)
    gone = stack.post("/v1/embeddings", {"model": MODEL, "input": "hi"})
    assert gone.status_code == 404 and gone.headers["x-request-id"]
    msg = gone.json()["error"]["message"]
    assert "POST /v1/embeddings" in msg and "POST /v1/responses" in msg and "GET /health" in msg
    assert httpx.get(stack.base + "/health").headers["x-request-id"]
    (m,) = stack.sdk.models.list().data
    assert m.id == MODEL and m.created > 1_600_000_000


# ---------------------------------------------------------------- the Responses API

def test_responses_plain_and_stored(stack):
    c = stack.sdk
    r = c.responses.create(model=MODEL, instructions="Answer in one word.",
                           input="What is the capital of France?", max_output_tokens=8,
                           temperature=0, metadata={"run": "1"})
    assert r.object == "response" and r.id.startswith("resp_") and r.output_text
    assert r.status in ("completed", "incomplete") and r.usage.input_tokens > 0
    assert r.metadata == {"run": "1"} and r.instructions == "Answer in one word."
    got = c.responses.retrieve(r.id)
    assert got.output_text == r.output_text and got.usage.output_tokens == r.usage.output_tokens
    follow = c.responses.create(model=MODEL, previous_response_id=r.id, max_output_tokens=8,
                                input="And of Germany?", temperature=0)
    assert follow.previous_response_id == r.id and follow.output_text
    assert follow.usage.input_tokens > r.usage.input_tokens  # the earlier turn came along
    unstored = c.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model=MODEL, input="Hi", previous_response_id=unstored.id)
    assert e.value.param == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model=MODEL, input="Hi", tools=[{"type": "web_search"}])
    assert e.value.param == "tools.0"
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model=MODEL, input="Hi", background=True)
    assert e.value.param == "background"


def test_responses_streamed(stack):
    c = stack.sdk
    events = list(c.responses.create(model=MODEL, input="Count to five:", max_output_tokens=12,
                                     temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed",
                                                            "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens > 0
    assert c.responses.retrieve(final.id).output_text == text
    # the SDK's stream helper reads them too (its final response must be "completed": a
    # grammar that ends makes sure the output is not cut by max_output_tokens)
    digit = {"type": "json_schema", "name": "digit", "schema": {
        "type": "object", "required": ["n"], "additionalProperties": False,
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}}}
    with c.responses.stream(model=MODEL, input="Pick a digit.", max_output_tokens=30,
                            temperature=0, text={"format": digit}) as s:
        deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
        done = s.get_final_response()
    assert done.status == "completed" and json.loads(done.output_text)["n"] in range(10)
    assert "".join(deltas) == done.output_text


def test_responses_function_tools_round_trip(stack):
    c = stack.sdk
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = c.responses.create(model=MODEL, input=ask, tools=[WEATHER], temperature=0,
                               tool_choice={"type": "function", "name": "get_weather"},
                               max_output_tokens=40)
    (call,) = [o for o in first.output if o.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"]
    answer = c.responses.create(
        model=MODEL, tools=[WEATHER], temperature=0, max_output_tokens=30,
        input=[*ask, {"type": "function_call", "call_id": call.call_id, "name": call.name,
                      "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id,
                "output": json.dumps({"celsius": 21, "sky": "clear"})}], tool_choice="none")
    assert answer.output[0].type == "message" and answer.output_text
    chained = c.responses.create(model=MODEL, previous_response_id=first.id, tools=[WEATHER],
                                 tool_choice="none", temperature=0, max_output_tokens=30,
                                 input=[{"type": "function_call_output",
                                         "call_id": call.call_id, "output": "21 C, clear"}])
    assert chained.output_text
    events = list(c.responses.create(model=MODEL, input=ask, tools=[WEATHER], temperature=0,
                                     tool_choice="required", parallel_tool_calls=False,
                                     max_output_tokens=40, stream=True))
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [e.item.type for e in added] == ["function_call"]
    args = "".join(e.delta for e in events
                   if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == args and json.loads(args)["city"]
    assert events[-1].response.output[0].arguments == args


def test_responses_structured_output(stack):
    r = stack.sdk.responses.create(
        model=MODEL, input="Invent a person.", temperature=0, max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                         "strict": True}})
    jsonschema.validate(json.loads(r.output_text), PERSON)
    assert r.text.format.type == "json_schema"


# ---------------------------------------------------------------- batches

def test_a_batch_with_echo_usage_and_invalid_lines(stack, tmp_path):
    url = "/v1/completions"
    bodies = {"echo": {"prompt": "Hello there", "echo": True, "logprobs": 1, "max_tokens": 0},
              "gen": {"prompt": "Hello there", "max_tokens": 3, "temperature": 0, "store": True},
              "bad": {"prompt": ["a", "b"]}}
    c = stack.sdk
    b, rows = run_batch(c, tmp_path, url, bodies)
    assert b.status == "completed" and b.request_counts.completed == 2, b
    echo = rows["echo"]["response"]["body"]
    assert echo["choices"][0]["text"] == "Hello there"
    assert echo["choices"][0]["logprobs"]["token_logprobs"][0] is None
    assert echo["usage"]["completion_tokens"] == 0
    used = [r["response"]["body"]["usage"] for r in rows.values()]
    assert b.usage.input_tokens == sum(u["prompt_tokens"] for u in used) > 0
    assert b.usage.output_tokens == sum(u["completion_tokens"] for u in used) == 3
    assert b.usage.total_tokens == b.usage.input_tokens + b.usage.output_tokens
    (err,) = map(json.loads, c.files.content(b.error_file_id).text.splitlines())
    assert err["custom_id"] == "bad" and err["id"] == f"batch_req_{b.id}.3"
