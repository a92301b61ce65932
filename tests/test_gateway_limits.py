"""What the gateway refuses before anything is queued, and what it keeps bounded: JSON nested
past a limit, token ids outside the vocabulary the model's worker announced, a tool message
that names no call, uploads past their expiry or the tenant's quota, a full Redis (503).
A real `pagedq gateway` process (its upload expiry and quota set small), a real worker
serving the tiny chat Llama, a real redis-server; the official openai SDK and httpx."""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
import redis

from pagedq.wire.keys import Keys
from pagedq.worker.redis_server import RedisServer
from tests.model_fixtures import TINY_VOCAB, make_tiny_chat_model
from tests.test_gateway import PREFIX, Gateway, make_key
from tests.tiny_service import MODEL
from tests.waiting import until
from tests.worker_proc import WorkerProc

TTL_S, QUOTA = 3, 600  # the gateway's PAGEDQ_GATEWAY_UPLOAD_TTL_S and _QUOTA_BYTES here
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    srv = RedisServer().start()
    tiny = str(make_tiny_chat_model(tmp_path_factory.mktemp("tiny-limits")))
    batch_dir = tmp_path_factory.mktemp("limits-batches")
    w = WorkerProc(srv.url, PREFIX, model=tiny, extra=["--served-name", MODEL])
    gw = Gateway(srv.url, batch_dir, env={"PAGEDQ_GATEWAY_UPLOAD_TTL_S": str(TTL_S),
                                          "PAGEDQ_GATEWAY_UPLOAD_QUOTA_BYTES": str(QUOTA)})
    try:
        w.start()
        gw.wait_ready()
        r = redis.Redis.from_url(srv.url, decode_responses=True)
        # the worker announces its model's vocabulary with its heartbeat
        until(lambda: r.hget(Keys(PREFIX).vocab, MODEL) == str(TINY_VOCAB), "the vocabulary")
        key = make_key(srv.url)
        yield srv, gw, key, r, batch_dir
    finally:
        gw.stop()
        w.stop()
        srv.cleanup()


def sdk(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack[1].base + "/v1", api_key=stack[2], max_retries=0)


def post(stack, path: str, content: bytes) -> httpx.Response:
    return httpx.post(stack[1].base + path, content=content, timeout=60,
                      headers={"Authorization": f"Bearer {stack[2]}",
                               "Content-Type": "application/json"})


def test_json_nested_too_deep_is_a_400(stack):
    deep = b'{"model": "tiny", "prompt": "x", "metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = post(stack, "/v1/completions", deep)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
    assert "nested more than 100 levels" in r.json()["error"]["message"]
    past = {"model": MODEL, "prompt": "x", "metadata": {}}  # 101 levels, under the parser's
    inner: dict = past
    for _ in range(99):
        inner["metadata"] = inner = {"metadata": {}}
    r = post(stack, "/v1/completions", json.dumps(past).encode())
    assert r.status_code == 400 and "nested" in r.json()["error"]["message"], r.text
    r = post(stack, "/v1/completions", json.dumps({"model": MODEL, "prompt": "Hi",
                                                    "max_tokens": 2}).encode())
    assert r.status_code == 200, r.text
    assert "unexpected_error" not in stack[1].log(None)


def test_token_ids_outside_the_vocabulary_are_a_400(stack):
    c = sdk(stack)
    for kw, param in ((dict(prompt=[1, 2, TINY_VOCAB]), "prompt"),
                      (dict(prompt="Hi", logit_bias={str(TINY_VOCAB + 7): 1}), "logit_bias")):
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model=MODEL, max_tokens=2, **kw)
        assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
        assert e.value.body["code"] == "invalid_token_id"
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=MODEL, max_tokens=2, logit_bias={"99999": 5},
                                  messages=[{"role": "user", "content": "Hi"}])
    ok = c.completions.create(model=MODEL, max_tokens=2, prompt=[1, 2, TINY_VOCAB - 1],
                              logit_bias={"5": 1})
    assert 1 <= ok.usage.completion_tokens <= 2  # accepted (sampled: EOS may come first)


def test_a_tool_message_without_its_call_id_is_a_400(stack):
    c = sdk(stack)
    chat = [{"role": "user", "content": "add 1 and 2"},
            {"role": "assistant", "content": None, "tool_calls": [CALL]}]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, max_tokens=2,
                                  messages=[*chat, {"role": "tool", "content": "3"}])
    assert e.value.body["param"] == "messages[2].tool_call_id", e.value.body
    ok = c.chat.completions.create(model=MODEL, max_tokens=2, messages=[
        *chat, {"role": "tool", "content": "3", "tool_call_id": "call_1"}])
    assert 1 <= ok.usage.completion_tokens <= 2  # accepted (sampled: EOS may come first)


def upload(stack, n_lines: int) -> httpx.Response:
    line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                       "body": {"model": MODEL, "prompt": "x", "max_tokens": 2}})
    return httpx.post(stack[1].base + "/v1/files", data={"purpose": "batch"}, timeout=30,
                      headers={"Authorization": f"Bearer {stack[2]}"},
                      files={"file": ("in.jsonl", (line + "\n").encode() * n_lines)})


def test_uploads_expire_and_count_against_the_tenants_quota(stack):
    _srv, gw, key, r, batch_dir = stack
    files = openai.OpenAI(base_url=gw.base + "/v1", api_key=key, max_retries=0).files
    first = upload(stack, 2)  # about 250 bytes each: two fit the 600-byte quota, not three
    assert first.status_code == 200, first.text
    f = first.json()
    assert f["expires_at"] == f["created_at"] + TTL_S
    assert upload(stack, 2).status_code == 200
    third = upload(stack, 2)
    assert third.status_code == 400, third.text
    assert third.json()["error"]["code"] == "storage_quota_exceeded"
    on_disk = sorted(p.name for p in (Path(batch_dir) / "uploads" / PREFIX).iterdir())
    assert len(on_disk) == 2  # the refused one was not kept
    # past the expiry: gone from Redis, then (at the next list) from the index and the disk
    until(lambda: not r.exists(Keys(PREFIX).file(f["id"])), "the upload expired", 30, 0.2)
    with pytest.raises(openai.NotFoundError):
        files.retrieve(f["id"])
    until(lambda: not files.list().data, "both uploads expired", 30, 0.2)
    assert not list((Path(batch_dir) / "uploads" / PREFIX).iterdir())
    assert upload(stack, 2).status_code == 200  # the quota is free again


def test_a_full_redis_is_a_503(stack):
    srv, gw, key, r, _dir = stack
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", "1")
    try:
        resp = post(stack, "/v1/completions", json.dumps({"model": MODEL, "prompt": "Hi",
                                                          "max_tokens": 2}).encode())
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["code"] == "storage_full" and resp.headers["retry-after"]
    finally:
        r.config_set("maxmemory", "0")
    resp = post(stack, "/v1/completions", json.dumps({"model": MODEL, "prompt": "Hi",
                                                      "max_tokens": 2}).encode())
    assert resp.status_code == 200, resp.text
