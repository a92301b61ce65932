"""The whole path: producer -> Redis stream -> real worker process (SmolLM2 on the CPU,
paged KV cache) -> tokens back through Redis."""
from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request

import pytest

from pagedq.producer import AsyncClient, Client
from pagedq.wire.errors import InvalidRequest
from pagedq.wire.keys import GROUP
from pagedq.worker.redis_server import free_port
from tests.waiting import until
from tests.worker_proc import WorkerProc

PROMPTS = ["What is the capital of France?", "Count from one to five.", "Say hi.",
           "Write one sentence about cats.", "What is 2+2?", "Name a color.",
           "Describe the moon in a few words.", "Tell me a fun fact about octopuses.",
           "Why do leaves fall?", "List three fruits."]


@pytest.fixture(scope="module")
def service(shared_redis_server):
    prefix = f"e2e{time.time_ns()}"
    w = WorkerProc(shared_redis_server.url, prefix,
                   extra=["--max-num-seqs", "16", "--metrics-port", str(free_port())]).start()
    client = Client(shared_redis_server.url, prefix=prefix, model="smollm2")
    yield client, w
    w.stop()
    client.close()


def test_concurrent_jobs_all_finish_and_streams_match(service):
    client, _w = service
    ids: list[str] = []
    lock = threading.Lock()

    def produce(chunk):
        for k, p in chunk:
            jid = client.submit(messages=[{"role": "user", "content": p}],
                                max_tokens=4 + 2 * k, temperature=0.0)
            with lock:
                ids.append(jid)

    jobs = list(enumerate(PROMPTS))
    threads = [threading.Thread(target=produce, args=(jobs[i::3],)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(ids)) == len(PROMPTS)
    for jid in ids:
        rec = client.result(jid, timeout=300)
        assert rec.status == "finished", rec
        assert rec.usage.prompt_tokens > 0 and rec.usage.completion_tokens > 0
        events = list(client.stream(jid, timeout=30))
        assert [e.index for e in events] == list(range(len(events)))
        assert events[-1].type == "final"
        deltas = "".join(e.delta for e in events[:-1])
        assert deltas == rec.text == events[-1].text
        assert sum(len(e.token_ids) for e in events[:-1]) == rec.usage.completion_tokens


def test_job_submitted_mid_generation_joins_running_batch(service):
    client, _w = service
    long_id = client.submit("Write a long story about a dragon.", max_tokens=64,
                            temperature=0.0, ignore_eos=True)
    it = client.stream(long_id, timeout=120)
    for _ in range(3):  # the long job is generating
        assert next(it).type == "token"
    short_id = client.submit("Say yes.", max_tokens=4, temperature=0.0, ignore_eos=True)
    short = client.result(short_id, timeout=120)
    long_now = client.status(long_id)
    assert short.status == "finished"
    assert long_now.status == "running", "the short job had to wait for the long one"
    assert client.result(long_id, timeout=300).usage.completion_tokens == 64


def test_late_reader_and_resume_from_index_get_every_token_once(service):
    client, _w = service
    jid = client.submit("Count from one to twenty.", max_tokens=24, temperature=0.0,
                        ignore_eos=True)
    it = client.stream(jid, timeout=120)
    first = [next(it) for _ in range(5)]  # "disconnect" after five events
    rec = client.result(jid, timeout=300)
    rest = list(client.stream(jid, from_index=5, timeout=30))  # reconnect from the cursor
    late = list(client.stream(jid, timeout=30))  # a reader that starts after the end
    assert [e.index for e in first + rest] == list(range(len(late)))
    assert [e.model_dump() for e in first + rest] == [e.model_dump() for e in late]
    assert "".join(e.delta for e in late[:-1]) == rec.text


def test_prompt_longer_than_context_fails_without_disturbing_others(service):
    client, _w = service
    ok_id = client.submit("Say hello.", max_tokens=6, temperature=0.0, ignore_eos=True)
    long_prompt = "hello " * 9000  # > 8192 tokens, the model's context
    bad_id = client.submit(long_prompt, max_tokens=4)
    bad = client.result(bad_id, timeout=120)
    assert bad.status == "failed" and "context" in bad.error
    assert client.result(ok_id, timeout=120).status == "finished"


def test_malformed_raw_entries_are_failed_and_worker_keeps_serving(service):
    client, _w = service
    r = client.redis
    stream = client.keys.jobs("smollm2")
    r.xadd(stream, {"garbage": "1"})
    r.xadd(stream, {"job": "raw-bad-json", "body": "{not json"})
    r.xadd(stream, {"job": "raw-bad-field", "body": '{"prompt": "x", "max_tokens": -3}'})
    good = client.submit("Say ok.", max_tokens=4, temperature=0.0, ignore_eos=True)
    assert client.result(good, timeout=120).status == "finished"
    for jid in ("raw-bad-json", "raw-bad-field"):
        rec = client.result(jid, timeout=60)
        assert rec.status == "failed" and rec.error.startswith(("malformed", "invalid"))
    dlq = r.xrange(client.keys.dlq("smollm2"))
    reasons = [f["reason"] for _id, f in dlq]
    assert any("no 'body'" in x for x in reasons)
    assert any("not JSON" in x for x in reasons)
    assert any("max_tokens" in x for x in reasons)
    assert r.xpending(stream, GROUP)["pending"] == 0


def test_bad_input_is_refused_at_submit_and_nothing_enqueued(service):
    client, _w = service
    stream, inbox = client.keys.jobs("smollm2"), client.keys.inbox("smollm2")
    before = client.redis.xlen(stream) + client.redis.llen(inbox)
    bad = [dict(prompt=""), dict(prompt="hi", max_tokens=-1), dict(prompt="hi", max_tokens=10**7),
           dict(prompt="hi", temperature=-0.5), dict(prompt="hi", bogus_field=1)]
    for kw in bad:
        with pytest.raises(InvalidRequest):
            client.submit(**kw)
    assert client.redis.xlen(stream) + client.redis.llen(inbox) == before



def test_metrics_endpoint_and_json_logs_without_prompts(service):
    client, w = service
    secret = "zebra-unicorn-secret-prompt"
    jid = client.submit(f"Repeat: {secret}", max_tokens=5, temperature=0.0, ignore_eos=True)
    assert client.result(jid, timeout=120).status == "finished"
    port = int(w.extra[w.extra.index("--metrics-port") + 1])
    deadline = time.time() + 15
    while True:  # queue gauges are read every few seconds; the job's end is counted by the
        # publisher thread after the result is committed, so a reader can see it first
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        samples = {line.split(" ")[0]: float(line.split(" ")[1]) for line in body.splitlines()
                   if line and not line.startswith("#")}
        # the queue gauges' labels besides lane (the text format sorts labels by name)
        queue = f'model="{client.model}",prefix="{w.prefix}"'
        counted = samples.get("pagedq:e2e_request_latency_seconds_count", 0) >= 1
        if f'pagedq:stream_length{{lane="batch",{queue}}}' in samples and counted \
                or time.time() > deadline:
            break
        time.sleep(0.5)
    for name in ("pagedq:num_requests_running", "pagedq:num_requests_waiting",
                 "pagedq:kv_cache_usage_perc", "pagedq:num_preemptions_total",
                 "pagedq:reclaims_total"):
        assert name in samples, name
    for lane in ("interactive", "batch"):  # the queue gauges, one per lane
        for name in ("pending_count", "oldest_pending_age_seconds", "dlq_size", "stream_length"):
            assert f'pagedq:{name}{{lane="{lane}",{queue}}}' in samples, (name, lane)
    assert samples["pagedq:generation_tokens_total"] >= 5
    assert samples["pagedq:prompt_tokens_total"] > 0
    assert samples['pagedq:time_to_first_token_seconds_count{lane="interactive"}'] >= 1
    assert samples["pagedq:e2e_request_latency_seconds_count"] >= 1
    assert samples['pagedq:request_queue_time_seconds_count{lane="interactive"}'] >= 1
    assert samples["pagedq:inter_token_latency_seconds_count"] >= 4
    def job_done() -> list[dict]:
        log = w.log(tail=None)
        lines = log[:log.rfind("\n") + 1].splitlines()  # whole lines: it may be mid-write
        events = [json.loads(x) for x in lines if x.startswith("{")]
        return [e for e in events if e.get("event") == "job_done" and e.get("job_id") == jid]

    # job_done is logged by the publisher thread after the result is committed
    done = until(job_done, "the job's job_done line", timeout=15, every=0.2)
    assert secret not in w.log(tail=None), "prompts must never be logged"
    assert done[0]["worker_id"] == w.worker_id and done[0]["status"] == "finished"


def test_token_id_prompts_and_out_of_vocab_ids(service):
    client, _w = service
    ok = client.submit([504, 3458, 282, 4649, 314], max_tokens=4, temperature=0.0, ignore_eos=True)
    bad = client.submit([1, 2, 10**9], max_tokens=4)
    assert client.result(ok, timeout=120).usage.prompt_tokens == 5
    rec = client.result(bad, timeout=120)
    assert rec.status == "failed" and "token ids" in rec.error


def test_prompt_logprobs_from_both_clients(service):
    """submit(prompt_logprobs=k): the job's event 0 carries the prompt's token count and
    one entry per prompt token (the first without a logprob); max_tokens 0 scores the
    prompt alone. The same through the asyncio client, with tokens and n = 2."""
    client, w = service
    ids = [504, 3458, 282, 4649, 314]
    job = client.submit(ids, max_tokens=0, prompt_logprobs=2)
    rec = client.result(job, timeout=120)
    assert (rec.status, rec.finish_reason, rec.usage.completion_tokens) == ("finished",
                                                                            "length", 0)
    first = next(iter(client.stream(job)))
    assert (first.index, first.prompt_tokens, first.token_ids) == (0, 5, [])
    plp = first.prompt_logprobs
    assert [e.id for e in plp] == ids and (plp[0].logprob, plp[0].rank) == (None, None)
    assert all(len(e.top) == 2 and e.logprob <= e.top[0].logprob + 1e-6 for e in plp[1:])

    async def run():
        async with AsyncClient(w.redis_url, prefix=w.prefix, model="smollm2") as ac:
            j = await ac.submit(ids, max_tokens=3, n=2, temperature=0.0, prompt_logprobs=0)
            return [e async for e in ac.stream(j, timeout=120)]
    events = asyncio.run(run())
    assert events[0].prompt_tokens == 5 and events[-1].type == "final"
    assert [(e.id, e.logprob) for e in events[0].prompt_logprobs] == [
        (e.id, e.logprob) for e in plp]
    assert all(e.prompt_logprobs is None and e.prompt_tokens is None for e in events[1:-1])
