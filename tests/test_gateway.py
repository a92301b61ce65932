"""The OpenAI-compatible gateway end to end: `pagedq gateway` as a real process (uvicorn),
a real redis-server, a real pagedq worker serving a tiny random Llama (with a chat
template) and, for batches, a real rq worker; driven with the official `openai` package
(sync and async), httpx for what the SDK hides (SSE ids, headers, early disconnects) and
the real `curl` for the documented examples. Nothing is mocked; every wait is a condition
with a deadline. One worker and one gateway for the whole module."""
from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import pytest
import redis

from pagedq.cli import main as pagedq_main
from pagedq.producer import Client
from pagedq.wire.settings import Settings
from pagedq.worker.redis_server import RedisServer
from tests.test_batch_e2e import RqWorker, until
from tests.tiny_service import MODEL
from tests.worker_proc import ROOT, WorkerProc

PREFIX = "rel"  # the tenant of the keys below, and the gateway's admin prefix (RqWorker's)
OTHER = "other"  # a tenant no worker serves
CHAT = [{"role": "user", "content": "Tell me a story"}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pagedq(*argv: str) -> tuple[int, str, str]:
    """`pagedq ARGV` in this process -> (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = pagedq_main(list(argv))
    return code, out.getvalue(), err.getvalue()


def make_key(url: str, *extra: str) -> str:
    code, out, err = pagedq("--redis-url", url, "--prefix", PREFIX, "gateway", "key", "add",
                            *extra)
    assert code == 0, err
    return out.strip()


class Gateway:
    """`pagedq gateway` with admin prefix ``prefix``; ``env``: e.g. its Redis user's."""

    def __init__(self, url: str, batch_dir: Path, prefix: str = PREFIX,
                 env: dict[str, str] | None = None, model: str = MODEL) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = tempfile.mktemp(prefix="pagedq-gateway-", suffix=".log")
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pagedq", "--redis-url", url, "gateway", "--prefix",
             prefix, "--port", str(self.port), "--auth", "on", "--model", model,
             "--batch-dir", str(batch_dir), "--log-level", "info"],
            stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT,
            env={**os.environ, "PYTHONPATH": ROOT, **(env or {})})

    def wait_ready(self) -> None:
        def up() -> bool:
            assert self.proc.poll() is None, self.log()
            try:
                return httpx.get(self.base + "/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False
        until(up, "the gateway answered /health", 60, 0.05)

    def log(self, tail: int | None = 4000) -> str:
        text = Path(self.log_path).read_text(errors="replace")
        return text[-tail:] if tail else text

    def stop(self) -> int:
        self.proc.terminate()
        try:
            code = self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self._log.close()
        return code


@pytest.fixture(scope="module")
def stack(tiny_dir, tmp_path_factory):
    """redis-server, a pagedq worker (steps slowed to 20 ms, so that a test can leave
    midway), the gateway, and API keys."""
    srv = RedisServer().start()
    batch_dir = tmp_path_factory.mktemp("gw-batches")
    w = WorkerProc(srv.url, PREFIX, model=tiny_dir,
                   extra=["--served-name", MODEL, "--max-num-seqs", "16"],
                   env={"PAGEDQ_LEASE_S": "2", "PAGEDQ_HEARTBEAT_TTL_S": "3",
                        "PAGEDQ_FAILPOINTS": "step_sleep_s=0.02"})
    gw = None
    try:
        w.start(wait=False)
        gw = Gateway(srv.url, batch_dir)

        class Stack:
            url, dir, worker, gateway = srv.url, batch_dir, w, gw
            key = make_key(srv.url, "--name", "main")
            other_key = make_key(srv.url, "--tenant", OTHER, "--name", "other")
            pq = Client(settings=Settings(redis_url=srv.url, prefix=PREFIX, model=MODEL))

            def sdk(self, key: str | None = None) -> openai.OpenAI:
                return openai.OpenAI(base_url=gw.base + "/v1", api_key=key or self.key,
                                     max_retries=0)

            def asdk(self, key: str | None = None) -> openai.AsyncOpenAI:
                return openai.AsyncOpenAI(base_url=gw.base + "/v1", api_key=key or self.key,
                                          max_retries=0)

            def headers(self, key: str | None = None) -> dict[str, str]:
                return {"Authorization": f"Bearer {key or self.key}"}

        gw.wait_ready()
        w.wait_ready()
        yield Stack()
        Stack.pq.close()
    finally:
        if gw is not None:
            assert gw.stop() == 0, gw.log()  # SIGTERM: a clean stop
        w.stop(10)
        srv.cleanup()


def job_of(response_id: str) -> str:
    return response_id.split("-", 1)[1]


def sse_events(lines):
    """(id, data) of each SSE event of a response's lines, as they arrive."""
    eid, data = None, []
    for line in lines:
        if line == "":
            if data:
                yield eid, "\n".join(data)
            eid, data = None, []
        elif line.startswith("id: "):
            eid = line[4:]
        elif line.startswith("data: "):
            data.append(line[6:])


def position(eid: str) -> tuple[int, int]:
    k, j = eid.rpartition("/")[2].split(".")
    return int(k), int(j)


# ---------------------------------------------------------------- the SDK, sync and async

def test_chat_non_streaming_n2_logprobs_usage(stack):
    c = stack.sdk()
    r = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, n=2, seed=5,
                                  logprobs=True, top_logprobs=2)
    rec = stack.pq.status(job_of(r.id))
    assert r.object == "chat.completion" and r.model == MODEL and len(r.choices) == 2
    assert [ch.message.content for ch in r.choices] == [x.text for x in rec.choices]
    for ch, want in zip(r.choices, rec.choices, strict=True):
        assert ch.message.role == "assistant" and ch.finish_reason == want.finish_reason
        # a token each (byte-level tokens: one may be part of a character)
        assert len(ch.logprobs.content) == want.completion_tokens > 0
        assert all(len(t.top_logprobs) == 2 for t in ch.logprobs.content)
    assert r.usage.prompt_tokens == rec.usage.prompt_tokens > 0
    assert r.usage.completion_tokens == rec.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_streaming_with_usage(stack):
    c = stack.sdk()
    chunks = list(c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12,
                                            stream=True,
                                            stream_options={"include_usage": True}))
    job = job_of(chunks[0].id)
    rec = stack.pq.status(job)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == rec.text
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finish[-1] == rec.finish_reason and not any(finish[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        rec.usage.completion_tokens
    assert all(ch.usage is None for ch in chunks[:-1])


def test_completions_async_streaming_and_not(stack):
    async def run():
        async with stack.asdk() as c:
            full = await c.completions.create(model=MODEL, prompt="Once upon a time",
                                              max_tokens=10, seed=11, logprobs=2)
            stream = await c.completions.create(model=MODEL, prompt="Once upon a time",
                                                max_tokens=10, seed=11, logprobs=2,
                                                stream=True)
            return full, [ch async for ch in stream]
    full, chunks = asyncio.run(run())
    assert full.object == "text_completion"
    ch0 = full.choices[0]
    assert ch0.text == stack.pq.status(job_of(full.id)).text
    assert len(ch0.logprobs.tokens) == full.usage.completion_tokens
    assert len(ch0.logprobs.top_logprobs[0]) == 2
    # the same seeded request, streamed: same text, same tokens, offsets continue
    text = "".join(ch.choices[0].text for ch in chunks)
    assert text == ch0.text
    tokens = [t for ch in chunks if ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens]
    offsets = [o for ch in chunks if ch.choices[0].logprobs
               for o in ch.choices[0].logprobs.text_offset]
    assert tokens == ch0.logprobs.tokens and offsets == ch0.logprobs.text_offset
    assert chunks[-1].choices[0].finish_reason == ch0.finish_reason


def test_models_list(stack):
    assert [m.id for m in stack.sdk().models.list()] == [MODEL]
    assert stack.sdk().models.retrieve(MODEL).owned_by == "pagedq"
    assert list(stack.sdk(stack.other_key).models.list()) == []  # another tenant


# ---------------------------------------------------------------- errors

def test_errors_in_openai_shape(stack):
    c = stack.sdk()
    with pytest.raises(openai.AuthenticationError) as e:
        stack.sdk("pq-not-a-key").models.list()
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    r = httpx.get(stack.gateway.base + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=CHAT, temperature=-1)
    assert e.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=CHAT,
                                  tools=[{"type": "function", "function": {"name": "f g"}}])
    assert e.value.param == "tools.0.function.name"
    with pytest.raises(openai.BadRequestError) as e:  # the legacy form of tools
        c.chat.completions.create(model=MODEL, messages=CHAT, extra_body={"functions": []})
    assert e.value.param == "functions"
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="no-such-model", prompt="hi")
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):  # the tenant's workers serve nothing
        stack.sdk(stack.other_key).completions.create(model=MODEL, prompt="hi")
    resp = httpx.post(stack.gateway.base + "/v1/completions", headers=stack.headers(),
                      content=b'{"prompt": "' + b"x" * (9 << 20) + b'"}')
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"
    # a model whose only worker died (a heartbeat that expired): 503, with Retry-After
    r = redis.Redis.from_url(stack.url)
    r.zadd(f"{{{PREFIX}}}:serving:gone", {"dead-worker": time.time() - 60})
    r.close()
    resp = httpx.post(stack.gateway.base + "/v1/completions", headers=stack.headers(),
                      json={"model": "gone", "prompt": "hi"})
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "no_worker"
    assert resp.headers["retry-after"]


def minute_has_room(seconds: float = 15.0) -> bool:
    """True unless the current one-minute rate window ends within ``seconds``."""
    return time.time() % 60 < 60 - seconds


def test_rate_limits_429_with_retry_after(stack):
    until(lambda: minute_has_room(), "a rate window with 15 s left", 20, 0.2)
    rpm2 = stack.sdk(make_key(stack.url, "--rpm", "2"))
    rpm2.models.list()
    rpm2.models.list()
    with pytest.raises(openai.RateLimitError) as e:
        rpm2.models.list()
    assert e.value.code == "rate_limit_exceeded"
    assert 1 <= int(e.value.response.headers["retry-after"]) <= 60
    # tokens: the first request is admitted into an empty window; its actual usage stays
    tpm = stack.sdk(make_key(stack.url, "--tpm", "30"))
    tpm.completions.create(model=MODEL, prompt="abcd", max_tokens=20,
                           extra_body={"ignore_eos": True})
    with pytest.raises(openai.RateLimitError) as e:
        tpm.completions.create(model=MODEL, prompt="abcd", max_tokens=20)
    assert "tokens" in e.value.message and e.value.response.headers["retry-after"]


def test_full_queue_is_429_with_retry_after(stack):
    """The queue's caps (PAGEDQ_MAX_QUEUED_JOBS) of a gateway: a job waits in the queue of
    a frozen worker, the next request is refused."""
    stack.worker.signal(signal.SIGSTOP)
    try:
        queued = stack.pq.submit(messages=CHAT, max_tokens=4)
        resp = asyncio.run(in_process(stack, "/v1/chat/completions",
                                      {"model": MODEL, "messages": CHAT, "max_tokens": 4},
                                      stack.headers(), max_queued_jobs=1))
        assert resp.status_code == 429, resp.text
        assert resp.json()["error"]["code"] == "overloaded" and resp.headers["retry-after"]
        stack.pq.cancel(queued)
    finally:
        stack.worker.signal(signal.SIGCONT)


async def in_process(stack, path: str, body: dict, headers: dict,
                     **settings) -> httpx.Response:
    """One request to another gateway: the app built in this process (its own clients, no
    state shared with the gateway process but Redis), ``settings`` its own."""
    from pagedq.batch import BatchSettings
    from pagedq.gateway.app import create_app
    from pagedq.gateway.settings import GatewaySettings
    app = create_app(Settings(redis_url=stack.url, prefix=PREFIX, model=MODEL, **settings),
                     GatewaySettings(auth="on"), BatchSettings(batch_dir=str(stack.dir)))
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://gw2", timeout=60) as http:
            return await http.post(path, json=body, headers=headers)
    finally:
        await app.state.gateway.aclose()


# ---------------------------------------------------------------- disconnects and resume

@contextlib.contextmanager
def stream_request(stack, extra_headers=None, **body):
    """A streaming chat request; leaving the block closes the connection."""
    with httpx.Client(timeout=30) as http, http.stream(
            "POST", stack.gateway.base + "/v1/chat/completions",
            headers={**stack.headers(), **(extra_headers or {})},
            json={"model": MODEL, "messages": CHAT, "stream": True, **body}) as resp:
        assert resp.status_code == 200, resp.read()
        yield resp


def test_disconnect_cancels_the_job_unless_detached(stack):
    for detach in (False, True):  # (the resume test detaches by the header)
        with stream_request(stack, max_tokens=80, ignore_eos=True,
                            pagedq={"detach": detach}) as resp:
            first_id, _ = next(sse_events(resp.iter_lines()))
        job = first_id.rpartition("/")[0]
        rec = until(lambda job=job: (x := stack.pq.status(job)).done and x, f"job {job} ended",
                    60)
        assert rec.status == ("finished" if detach else "cancelled"), rec
        assert rec.usage.completion_tokens == 80 if detach else \
            rec.usage.completion_tokens < 80
    # a non-streaming request whose client gives up
    job = "gw-gone-" + os.urandom(4).hex()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(stack.gateway.base + "/v1/chat/completions", headers=stack.headers(),
                   timeout=httpx.Timeout(30, read=0.5),
                   json={"model": MODEL, "messages": CHAT, "max_tokens": 80,
                         "ignore_eos": True, "pagedq": {"job_id": job}})
    rec = until(lambda: (x := stack.pq.status(job)).done and x, f"job {job} ended", 60)
    assert rec.status == "cancelled", rec


def test_last_event_id_resumes_without_gap_or_repeat(stack):
    body = {"max_tokens": 30, "n": 2, "seed": 42, "temperature": 1.0,
            "stream_options": {"include_usage": True}}
    seen: list[tuple[str, str]] = []
    with stream_request(stack, {"X-Pagedq-Detach": "1"}, **body) as resp:
        for eid, data in sse_events(resp.iter_lines()):
            seen.append((eid, data))
            if len(seen) == 4:
                break  # drop the connection midway; the job goes on (detached)
    last = seen[-1][0]
    # resumed on another gateway (an instance of the app in this process): they share Redis
    resp = asyncio.run(in_process(stack, "/v1/chat/completions", {
        "model": MODEL, "messages": CHAT, "stream": True, **body},
        {**stack.headers(), "Last-Event-ID": last}))
    assert resp.status_code == 200, resp.text
    seen += list(sse_events(resp.text.splitlines()))
    ids = [eid for eid, _ in seen]
    assert len(set(ids)) == len(ids)
    pos = [position(i) for i in ids]
    for (k0, j0), (k1, j1) in zip(pos, pos[1:], strict=False):
        assert (k1, j1) in ((k0, j0 + 1), (k0 + 1, 0)), (ids, (k0, j0), (k1, j1))
    assert seen[-1][1] == "[DONE]"
    # the same seeded request in one go, never interrupted
    with stream_request(stack, **body) as resp:
        whole = list(sse_events(resp.iter_lines()))

    def texts(events):
        out: dict[int, str] = {}
        for _, data in events:
            if data != "[DONE]":
                for ch in json.loads(data)["choices"]:
                    out[ch["index"]] = out.get(ch["index"], "") + ch["delta"].get("content", "")
        return out
    assert texts(seen) == texts(whole) and len(texts(whole)) == 2
    job = ids[0].rpartition("/")[0]
    rec = stack.pq.status(job)
    assert rec.status == "finished" and [c.text for c in rec.choices] == \
        [texts(seen)[0], texts(seen)[1]]


# ---------------------------------------------------------------- files and batches

@pytest.fixture(scope="module")
def rq_worker(stack):
    w = RqWorker(stack.url, stack.dir).start()
    yield w
    w.stop()


def test_batch_from_a_jsonl_file(stack, rq_worker, tmp_path):
    lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": MODEL, "messages": [{"role": "user", "content": f"hi {i}"}],
                       "max_tokens": 4}} for i in range(3)]
    src = tmp_path / "requests.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    c = stack.sdk()
    f = c.files.create(file=src.open("rb"), purpose="batch")
    assert f.bytes == src.stat().st_size and c.files.retrieve(f.id).filename == "requests.jsonl"
    assert c.files.content(f.id).content == src.read_bytes()
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                         completion_window="24h", metadata={"team": "qa"})
    assert b.status in ("validating", "in_progress") and b.input_file_id == f.id
    b = until(lambda: (x := c.batches.retrieve(b.id)).status in (
        "completed", "failed", "expired", "cancelled") and x, "the batch ended", 120, 0.2)
    assert b.status == "completed", b
    assert b.request_counts.total == 3 and b.request_counts.completed == 3
    assert b.metadata == {"team": "qa"} and b.endpoint == "/v1/chat/completions"
    rows = [json.loads(x) for x in c.files.content(b.output_file_id).text.splitlines()]
    assert [r["custom_id"] for r in rows] == ["q0", "q1", "q2"]
    assert all(r["response"]["body"]["object"] == "chat.completion" for r in rows)
    assert c.files.content(b.error_file_id).text == ""
    assert b.id in [x.id for x in c.batches.list()]
    with pytest.raises(openai.ConflictError):
        c.batches.cancel(b.id)  # already over
    with pytest.raises(openai.NotFoundError):  # other tenants do not see it
        stack.sdk(stack.other_key).batches.retrieve(b.id)
    with pytest.raises(openai.BadRequestError):
        c.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                         completion_window="24h")  # the lines are chat lines


def test_batch_line_naming_an_unserved_model_is_its_own_error(stack, rq_worker, tmp_path):
    """A line naming a model this deployment does not serve (gpt-4o) is that line's
    model_mismatch, as with the CLI; the batch runs the served model for the others."""
    lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": model, "prompt": f"count {i}", "max_tokens": 2}}
             for i, model in enumerate([MODEL, "gpt-4o", MODEL])]
    lines.append({"custom_id": "q3", "method": "POST", "url": "/v1/completions",
                  "body": {"prompt": "no model named", "max_tokens": 2}})
    src = tmp_path / "mixed.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    c = stack.sdk()
    f = c.files.create(file=src.open("rb"), purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                         completion_window="24h")
    b = until(lambda: (x := c.batches.retrieve(b.id)).status in (
        "completed", "failed", "expired", "cancelled") and x, "the batch ended", 120, 0.2)
    assert b.status == "completed", b
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == \
        (4, 3, 1)
    out = [json.loads(x) for x in c.files.content(b.output_file_id).text.splitlines()]
    assert [r["custom_id"] for r in out] == ["q0", "q2", "q3"]
    assert {r["response"]["body"]["model"] for r in out} == {MODEL}
    (err,) = [json.loads(x) for x in c.files.content(b.error_file_id).text.splitlines()]
    assert err["custom_id"] == "q1" and err["error"]["code"] == "model_mismatch"
    assert "gpt-4o" in err["error"]["message"] and err["error"]["line"] == 2


# ---------------------------------------------------------------- documented examples, CLI

def curl_blocks() -> list[str]:
    """The ```sh blocks after a ``gateway-curl`` marker, in README.md and docs/gateway.md."""
    blocks = []
    for doc in ("README.md", "docs/gateway.md"):
        text = Path(ROOT, doc).read_text()
        found = re.findall(r"<!-- gateway-curl\b[^\n]*-->\n```sh\n(.*?)\n```$", text,
                           re.M | re.S)
        assert found, f"{doc} lost its gateway-curl block (or its marker)"
        blocks += found
    return blocks


@pytest.mark.skipif(not shutil.which("curl"), reason="needs curl")
def test_curl_examples_of_the_docs_run(stack):
    for block in curl_blocks():
        res = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block], capture_output=True,
                             text=True, timeout=120,
                             env={**os.environ, "PAGEDQ_GATEWAY": stack.gateway.base,
                                  "PAGEDQ_API_KEY": stack.key, "MODEL": MODEL})
        assert res.returncode == 0, block + res.stdout + res.stderr
        out = res.stdout.replace(" ", "")
        assert '"object":"chat.completion"' in out, res.stdout
        assert "data: [DONE]" in res.stdout, res.stdout
        if "/v1/responses" in block:
            assert '"object":"response"' in out, res.stdout
        if '"echo": true' in block:  # the prompt's first token has no logprob
            assert out.count('"token_logprobs":[null,') == 2, res.stdout


def test_openai_sdk_example_of_the_docs_runs(stack):
    """docs/gateway.md's Python block (its ``gateway-sdk`` marker), as written, against
    this gateway: it ends with the usage chunk's token count."""
    text = Path(ROOT, "docs/gateway.md").read_text()
    block, = re.findall(r"<!-- gateway-sdk\b[^\n]*-->\n```python\n(.*?)\n```$", text,
                        re.M | re.S)
    res = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PAGEDQ_GATEWAY": stack.gateway.base,
                                           "PAGEDQ_API_KEY": stack.key, "MODEL": MODEL})
    assert res.returncode == 0, res.stdout + res.stderr
    assert re.search(r"\ntokens: \d+$", res.stdout.rstrip()), res.stdout


def test_cli_keys_and_errors(stack, tmp_path):
    code, out, _ = pagedq("--redis-url", stack.url, "gateway", "key", "list", "--prefix",
                          PREFIX)
    rows = [json.loads(x) for x in out.splitlines()]
    assert code == 0 and {"main", "other"} <= {r["name"] for r in rows}
    assert stack.key not in out  # keys are never shown again
    key = make_key(stack.url, "--name", "short-lived")
    stack.sdk(key).models.list()
    code, out, _ = pagedq("--redis-url", stack.url, "--prefix", PREFIX, "gateway", "key",
                          "revoke", "short-lived")
    assert code == 0 and len(out.split()) == 1
    with pytest.raises(openai.AuthenticationError):
        stack.sdk(key).models.list()
    assert pagedq("--redis-url", stack.url, "gateway", "key", "revoke", "nobody")[0] == 3
    code, _, err = pagedq("--redis-url", stack.url, "gateway", "key", "add", "--rpm", "-1")
    assert code == 2 and err.startswith("pagedq: ") and len(err.splitlines()) == 1
    # the keys file store
    kf = tmp_path / "keys.jsonl"
    code, out, _ = pagedq("gateway", "key", "add", "--keys-file", str(kf), "--tenant", "t1")
    assert code == 0 and out.strip() not in kf.read_text()
    assert json.loads(kf.read_text())["tenant"] == "t1"
    # the server's start-up checks: one line each, documented codes
    for argv, want in (
            (["--redis-url", stack.url, "gateway", "--port", "0"], 78),
            (["--redis-url", stack.url, "gateway", "--port", str(stack.gateway.port)], 78),
            (["--redis-url", stack.url, "gateway", "--keys-file", str(tmp_path / "none")], 78),
            (["--redis-url", f"redis://127.0.0.1:{free_port()}/0", "gateway", "--port",
              str(free_port())], 1)):
        code, _, err = pagedq(*argv)
        assert code == want and err.startswith("pagedq: ") and len(err.splitlines()) == 1, err


def test_logs_name_key_ids_never_keys(stack):
    with stream_request(stack, max_tokens=80, ignore_eos=True) as resp:
        job = next(sse_events(resp.iter_lines()))[0].rpartition("/")[0]
    until(lambda: f"client_gone_job_cancelled job_id={job} key_id=" in stack.gateway.log(None),
          "the gateway logged the cancel", 30, 0.05)
    log = stack.gateway.log(None)
    assert stack.key not in log and stack.other_key not in log
    assert "pq-" not in log


def gateway_samples(base: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, from the gateway's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(base + "/metrics", timeout=5)  # no API key: as /health
    assert r.status_code == 200, r.text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def test_metrics_count_requests_rejections_latency_and_open_streams(stack):
    base, route = stack.gateway.base, "/v1/chat/completions"
    before = gateway_samples(base)
    rejected = {reason: ("pagedq:gateway_rejections_total", (("reason", reason),))
                for reason in ("invalid_api_key", "missing_api_key", "rate_limited")}
    assert all(key in before for key in rejected.values())  # at 0 from the start
    for name in ("process_cpu_seconds_total", "process_resident_memory_bytes",
                 "process_open_fds"):
        assert (name, ()) in before, name
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2, "temperature": 0}
    assert httpx.post(base + route, json=chat, headers=stack.headers(),
                      timeout=60).status_code == 200
    assert httpx.post(base + route, json=chat, headers=stack.headers("pq-not-a-key"),
                      timeout=60).status_code == 401
    with httpx.stream("POST", base + route, json={**chat, "stream": True},
                      headers=stack.headers(), timeout=60) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith(("data:", "id:", ":"))  # the stream is open
        assert gateway_samples(base)["pagedq:gateway_streams_open", ()] == 1
        assert list(lines)[-1] in ("data: [DONE]", "")
    after = until(lambda: (lambda s: s if s["pagedq:gateway_streams_open", ()] == 0 else None)(
        gateway_samples(base)), "the stream counted closed", 10, 0.05)

    def grew(name: str, labels: dict[str, str]) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)
    req = "pagedq:gateway_requests_total"
    assert grew(req, dict(route=route, method="POST", status="200", tenant=PREFIX)) == 2
    assert grew(req, dict(route=route, method="POST", status="401", tenant="")) == 1
    assert grew("pagedq:gateway_rejections_total", dict(reason="invalid_api_key")) == 1
    assert grew("pagedq:gateway_request_duration_seconds_count", dict(route=route)) == 3
