"""OpenAI's request fields (wire/openai_fields.py, wire/openai_api.py ``shape``) and the
Responses API's mapping (gateway/responses_api.py), property by property: ignored fields
change no job, refused ones are named, prompt lists make a job each, echo asks for the
prompt's logprobs, input items become the chat a job runs. Pure (no Redis): the same
mappings run through a real worker in tests/test_gateway_compat.py."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedq.gateway import responses_api as R
from pagedq.wire.openai_api import Echo, completion_logprobs, shape
from pagedq.wire.openai_fields import IGNORED, REFUSED, FieldError
from pagedq.wire.schema import JobRequest

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                    lambda x: st.lists(x, max_size=3) | st.dictionaries(st.text(max_size=5),
                                                                           x, max_size=3),
                    max_leaves=6)
BASE = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0.5}


def job(kind: str, body: dict) -> list[JobRequest]:
    data = dict(body)
    sh = shape(kind, data)
    return [JobRequest.model_validate({**data, **({} if p is None else {"prompt": p}),
                                       "id": "j", "model": "m"}) for p in sh.prompts]


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.sampled_from(IGNORED), JSON, min_size=1),
       st.sampled_from([None, ["text"]]))
def test_ignored_fields_change_no_job(extra, modalities):
    body = {**BASE, **extra}
    if modalities is not None:
        body["modalities"] = modalities
    assert [r.body_json() for r in job("chat", body)] == [r.body_json()
                                                         for r in job("chat", BASE)]


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(sorted(REFUSED)), JSON.filter(lambda v: v is not None))
def test_fields_that_would_change_the_output_are_refused_by_name(name, value):
    with pytest.raises(FieldError) as e:
        shape("chat", {**BASE, name: value})
    assert e.value.param == name and str(e.value).startswith(f"{name}: ")


@pytest.mark.parametrize("body,param", [
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"prompt": "x", "best_of": 2}, "best_of"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "echo": 1}, "echo"),
    ({"prompt": "x", "prompt_logprobs": 2}, "prompt_logprobs"),
    ({"prompt": "x", "echo": True, "logprobs": 2, "prompt_logprobs": 1}, "prompt_logprobs"),
    ({"messages": [], "prompt": "x"}, "messages"),
])
def test_completions_fields_refused_by_name(body, param):
    with pytest.raises(FieldError) as e:
        shape("completion", dict(body))
    assert e.value.param == param


@given(st.lists(st.text(min_size=1, max_size=5).filter(str.strip), min_size=1, max_size=5)
       | st.lists(st.lists(st.integers(0, 999), min_size=1, max_size=4), min_size=1,
                  max_size=5))
def test_a_list_of_prompts_is_a_job_each_and_token_ids_one_prompt(prompts):
    reqs = job("completion", {"prompt": prompts, "best_of": 2, "n": 2})
    assert [r.prompt for r in reqs] == prompts and all(r.n == 2 for r in reqs)
    if isinstance(prompts[0], list):  # one prompt of token ids
        assert [r.prompt for r in job("completion", {"prompt": prompts[0]})] == [prompts[0]]


def test_echo_asks_for_the_prompts_logprobs_and_renders_them_first():
    (r,) = job("completion", {"prompt": "ab", "echo": True, "logprobs": 3, "max_tokens": 0})
    assert (r.prompt_logprobs, r.logprobs, r.max_tokens) == (3, 3, 0)
    (r,) = job("completion", {"prompt": "ab", "echo": True})
    assert (r.prompt_logprobs, r.logprobs) == (0, None)  # the tokens' texts, no logprobs
    plp = [{"id": 1, "token": "a", "logprob": None, "rank": None, "top": []},
           {"id": 2, "token": "b", "logprob": -1.0, "rank": 1,
            "top": [{"id": 2, "token": "b", "logprob": -1.0}]}]
    assert Echo.of(None, plp, True) == Echo("ab", plp)  # token ids: spelled by the tokens
    assert Echo.of("a b", plp, False) == Echo("a b", None)
    assert completion_logprobs(plp)["top_logprobs"] == [None, {"b": -1.0}]


# ---------------------------------------------------------------- the Responses API

def fields(body: dict, history=None):
    return R.request_fields(body, history)


def test_input_items_become_the_chat_a_job_runs():
    items = [{"role": "developer", "content": [{"type": "input_text", "text": "be brief"}]},
             {"type": "message", "role": "user", "content": "weather?"},
             {"type": "reasoning", "summary": []},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"a\": 1}"},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
             {"type": "function_call_output", "call_id": "c2",
              "output": [{"type": "input_text", "text": "42"}]}]
    data, echoed, chat = fields({"input": items, "instructions": "sys", "max_output_tokens": 7,
                                 "top_logprobs": 2, "metadata": {"a": "b"}})
    assert [m["role"] for m in data["messages"]] == ["system", "developer", "user",
                                                       "assistant", "tool", "tool"]
    assert data["messages"][0]["content"] == "sys" and chat == data["messages"][1:]
    assert [c["id"] for c in data["messages"][3]["tool_calls"]] == ["c1", "c2"]
    assert data["messages"][5]["content"] == "42"
    assert (data["max_tokens"], data["logprobs"]) == (7, 2)
    assert echoed["instructions"] == "sys" and echoed["metadata"] == {"a": "b"}
    req = JobRequest.model_validate({**data, "id": "j", "model": "m"})
    assert req.messages[3].tool_calls[1].function.name == "g"
    data, _, chat = fields({"input": "again"}, history=chat)  # previous_response_id's chat
    assert [m["role"] for m in data["messages"]] == [m["role"] for m in chat]
    assert chat[-1] == {"role": "user", "content": "again"}


def test_tools_and_text_format_map_onto_chat_fields():
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}
    data, _, _ = fields({"input": "x", "tools": [tool],
                         "tool_choice": {"type": "function", "name": "f"},
                         "text": {"format": {"type": "json_schema", "name": "p",
                                             "schema": {"type": "object"}},
                                  "verbosity": "low"}})
    assert data["tools"] == [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object"}, "strict": True}}]
    assert data["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert data["response_format"]["json_schema"]["schema"] == {"type": "object"}
    req = JobRequest.model_validate({**data, "id": "j", "model": "m"})
    assert req.tools_active and req.guided.kind == "json_schema"


@pytest.mark.parametrize("body,param", [
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "x": 1}]}, "tools.0"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input.0.content"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "conversation": "c"}, "conversation"),
    ({"input": "x", "prompt": {"id": "p"}}, "prompt"),
    ({"input": "x", "max_tool_calls": 2}, "max_tool_calls"),
    ({"input": "x", "messages": []}, "messages"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format"),
    ({"input": "x", "tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"input": "x", "include": "all"}, "include"),
])
def test_what_the_responses_api_refuses_is_named(body, param):
    with pytest.raises(FieldError) as e:
        fields(body)
    assert e.value.param == param


def test_ignored_responses_fields_change_nothing():
    plain, _, _ = fields({"input": "x"})
    more, _, _ = fields({"input": "x", "service_tier": "auto", "reasoning": {"effort": "low"},
                         "truncation": "auto", "include": [R.LOGPROBS_ITEM],
                         "prompt_cache_key": "k", "safety_identifier": "s"})
    assert {k: v for k, v in more.items() if k != "logprobs"} == plain
    assert more["logprobs"] == 0  # include's message.output_text.logprobs is served
