"""Tool calling's pure parts: the request's tool fields (wire/schema.py, wire/tools.py),
the output grammar of each tool_choice (compiled by llguidance against a real tokenizer),
reading calls out of a text whole or as it streams (hypothesis: any split), the OpenAI
shapes (wire/openai_api.py) and the worker's rendering of a chat with tools (worker/chat.py:
a template that knows tools, and the fallback for one that does not)."""
from __future__ import annotations

import json

import llguidance
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedq.wire.guided import GuidedSpec, validate_guided
from pagedq.wire.openai_api import CallStream, choice_body, response_body
from pagedq.wire.schema import JobRequest
from pagedq.wire.scripts import queued_tokens_of
from pagedq.wire.tools import CallScanner, call_id, calls_of
from pagedq.worker import chat
from tests.model_fixtures import tiny_tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: {}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'


def request(**kw) -> JobRequest:
    return JobRequest.model_validate({"messages": ASK, "tools": [WEATHER, TIME], **kw})


@pytest.fixture(scope="module")
def accepts():
    """accepts(spec, text): whether the spec's grammar takes text whole (then EOS)."""
    from pagedq.wire.guided import grammar_of
    hf = tiny_tokenizer()
    tok = llguidance.LLTokenizer(hf.backend_tokenizer.to_str(), n_vocab=512, eos_token=256)

    def check(spec: GuidedSpec, text: str) -> bool:
        m = llguidance.LLMatcher(tok, grammar_of(spec), log_level=0)
        return m.consume_tokens(hf.encode(text)) and m.is_accepting()
    return check


def test_each_tool_choice_has_its_grammar(accepts):
    two = '[{"name": "get_weather", "arguments": {"city": "A"}}, {"name": "get_time", "arguments": {}}]'
    cases = {
        "auto": (request(), [CALL, two, "Hello", "", "{not a call"], ["[oops", '[{"name": "x"']),
        "required": (request(tool_choice="required"), [CALL, two], ["Hello", ""]),
        "one": (request(tool_choice="required", parallel_tool_calls=False), [CALL], [two]),
        "named": (request(tool_choice={"type": "function", "function": {"name": "get_time"}}),
                  ['[{"name": "get_time", "arguments": {}}]'], [CALL, "Hi"]),
        "closed": (request(tool_choice="required"), [],  # unlisted keys: refused
                   ['[{"name": "get_weather", "arguments": {"city": "A", "x": 1}}]']),
        "json answer": (request(guided={"json_schema": {"type": "object", "properties": {
            "a": {"type": "integer"}}}}), [CALL, '{"a": 1}'], ["Hello", '{"b": 2}']),
    }
    for name, (req, good, bad) in cases.items():
        spec = req.output_spec()
        validate_guided(spec)
        for text in good:
            assert accepts(spec, text), (name, text)
        for text in bad:
            assert not accepts(spec, text), (name, text)
    assert request(tool_choice="none").output_spec() is None
    none = request(tool_choice="none", guided={"regex": "a"})
    assert none.output_spec() == GuidedSpec("regex", "a") and not none.tools_active
    assert request().output_spec() == request().output_spec()  # the worker derives it again


def test_tool_fields_round_trip_and_rules():
    req = request(tool_choice="required", parallel_tool_calls=False, logit_bias={"3": -1.5},
                  messages=ASK + [
                      {"role": "assistant", "content": None, "tool_calls": [
                          {"id": "c1", "type": "function",
                           "function": {"name": "get_weather", "arguments": '{"city": "P"}'}}]},
                      {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])
    body = req.body_json()
    assert JobRequest.model_validate_json(body).body_json() == body  # same bytes again
    assert json.loads(body)["logit_bias"] == {"3": -1.5}
    assert queued_tokens_of(req) > queued_tokens_of(JobRequest.model_validate(
        {"messages": ASK}))  # the tools' JSON and the call's arguments count
    for bad, message in [
        ({"role": "user", "content": "x", "tool_calls": [
            {"id": "c", "function": {"name": "f", "arguments": "{}"}}]}, "only an assistant"),
        ({"role": "user", "content": "x", "tool_call_id": "c"}, "only a tool message"),
        ({"role": "assistant", "content": None}, "content is required"),
    ]:
        with pytest.raises(ValueError, match=message):
            JobRequest.model_validate({"messages": [bad, *ASK]})
    assert JobRequest.model_validate({"messages": ASK, "tools": []}).tools is None
    assert JobRequest.model_validate({"messages": ASK, "tool_choice": "none"}).tool_choice == "none"


calls = st.lists(st.fixed_dictionaries({
    "name": st.sampled_from(["f", "get_weather", "a-b_1"]),
    "arguments": st.dictionaries(st.text(max_size=6), st.one_of(
        st.text(alphabet='ab"}{][\\, ', max_size=8), st.integers(),
        st.lists(st.dictionaries(st.text(max_size=3), st.booleans(), max_size=2), max_size=2)),
        max_size=3)}).map(lambda d: {"name": d["name"], "arguments": d["arguments"]}),
    min_size=1, max_size=3)  # name first, as the grammar writes a call


@settings(max_examples=60, deadline=None)
@given(value=calls, cuts=st.lists(st.integers(0, 400), max_size=8))
def test_calls_read_whole_and_streamed_in_any_split(value, cuts):
    text = json.dumps(value)  # the grammar's format: json.dumps' separators
    whole = calls_of(text)
    assert [(n, json.loads(a)) for n, a in whole] == [(c["name"], c["arguments"]) for c in value]
    stream, bounds = CallStream("job", 1), sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    deltas = [d for a, b in zip(bounds, bounds[1:], strict=False) for d in stream.feed(text[a:b])]
    heads = [d for d in deltas if "id" in d]
    assert [d["index"] for d in heads] == list(range(len(value)))
    assert [d["id"] for d in heads] == [call_id("job", 1, k) for k in range(len(value))]
    for k, (name, args) in enumerate(whole):
        assert heads[k]["function"]["name"] == name
        assert "".join(d["function"]["arguments"] for d in deltas if d["index"] == k) == args
    for cut in bounds[1:-1]:  # a prefix is never calls
        assert calls_of(text[:cut]) is None


def test_calls_of_refuses_what_is_not_calls():
    for text in ["", "Hello", "[]", "[1]", '[{"name": "f"}]', '{"name": "f", "arguments": {}}',
                 '[{"name": "f", "arguments": {}, "x": 1}]', CALL[:-1], " " + CALL]:
        assert calls_of(text) is None, text
    assert CallStream("j", 0).feed("Hello") is None  # text: sent as content
    s = CallScanner()
    assert s.feed("[") == [] and s.feed('{"name": "f", "arguments": ') == [(0, True, "")]


def test_openai_shapes_of_calls_and_of_text():
    c = {"index": 0, "text": CALL, "finish_reason": "stop"}
    body = choice_body("chat", c, None, "job1")
    assert body["finish_reason"] == "tool_calls" and body["message"]["content"] is None
    assert body["message"]["tool_calls"] == [{"id": call_id("job1", 0, 0), "type": "function",
                                              "function": {"name": "get_weather",
                                                           "arguments": '{"city": "Paris"}'}}]
    cut = choice_body("chat", {**c, "text": CALL[:20], "finish_reason": "length"}, None, "j")
    assert cut["message"]["content"] == CALL[:20] and cut["finish_reason"] == "length"
    assert choice_body("chat", c, None)["message"]["content"] == CALL  # tools not active
    r = response_body("chat", "job1", "m", 0, [c], None, 3, 4, tools=True)
    assert r["choices"][0]["finish_reason"] == "tool_calls"


def test_fallback_rendering_of_a_chat_with_tools():
    req = request(messages=ASK + [
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "c1", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "noon"}])
    msgs = chat.fallback_messages(req.messages, req.tools, req.tool_choice)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert msgs[0]["content"].startswith("You can call these tools:\n{\"name\": \"get_weather\"")
    assert "Otherwise answer normally." in msgs[0]["content"]
    assert msgs[2]["content"] == ('Let me look.\n[{"name": "get_weather", "arguments": '
                                  '{"city": "Paris"}}, {"name": "get_time", "arguments": {}}]')
    assert msgs[3]["content"] == "Tool result (get_weather): sunny\nTool result (get_time): noon"
    system = [{"role": "system", "content": "Be brief."}, *ASK]
    named = request(messages=system, tool_choice={"type": "function",
                                                  "function": {"name": "get_time"}})
    first = chat.fallback_messages(named.messages, named.tools, named.tool_choice)[0]["content"]
    assert "Call the tool get_time" in first and first.endswith("\n\nBe brief.")
    tok = tiny_tokenizer()
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                         "{% endfor %}assistant: ")
    text = tok.decode(chat.prompt_ids(tok, req))
    assert text.startswith("system: You can call these tools:") and "Tool result" in text
    none = request(tool_choice="none")  # no tools in the prompt
    assert tok.decode(chat.prompt_ids(tok, none)) == "user: Weather in Paris?\nassistant: "


def test_a_template_that_knows_tools_gets_them():
    tok = tiny_tokenizer()
    tok.chat_template = (
        "{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}"
        "{% for c in m.tool_calls or [] %} CALL {{ c.function.name }} "
        "{{ c.function.arguments.city }} {{ c.id }}{% endfor %}"
        "{% if m.tool_call_id %} FOR {{ m.tool_call_id }}{% endif %}|{% endfor %}assistant: ")
    req = request(messages=ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])
    text = tok.decode(chat.prompt_ids(tok, req))
    assert text.startswith('TOOLS [{"type": "function", "function": {"name": "get_weather"')
    assert "|assistant:  CALL get_weather Paris c1|tool: sunny FOR c1|" in text
    assert chat.needs_rendering(req) and not chat.needs_rendering(JobRequest(prompt="x"))
    tok.chat_template = "{{ raise_exception('no tools here') }} tools"
    with pytest.raises(ValueError, match="the model's chat template refused the messages"):
        chat.prompt_ids(tok, req)
    with pytest.raises(ValueError, match="this model has no tokenizer"):
        chat.prompt_ids(None, req)
