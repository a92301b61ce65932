"""The queue gauges of one worker serving two tenants (`--prefixes`): one series per
queue, labelled prefix, model and lane, as its /metrics endpoint serves them. A real
worker process and redis-server; nothing mocked, every wait a condition with a deadline."""
from __future__ import annotations

import urllib.request

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from pagedq.wire.keys import Keys
from pagedq.worker.redis_server import free_port
from tests.tiny_service import MODEL
from tests.waiting import until
from tests.worker_proc import WorkerProc

A, B = "qm-a", "qm-b"
QUEUE_GAUGES = ("pagedq:stream_length", "pagedq:pending_count", "pagedq:dlq_size",
                "pagedq:oldest_pending_age_seconds")


def queue_samples(port: int) -> dict[tuple[str, str, str, str], float]:
    """(gauge, prefix, model, lane) -> value, from the worker's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        body = r.read().decode()
    return {(s.name, s.labels["prefix"], s.labels["model"], s.labels["lane"]): s.value
            for fam in text_string_to_metric_families(body) for s in fam.samples
            if s.name in QUEUE_GAUGES}


def test_a_worker_serving_two_prefixes_exports_each_prefixs_queue(redis_server, tiny_dir):
    port = free_port()
    w = WorkerProc(redis_server.url, A, model=tiny_dir,
                   extra=["--served-name", MODEL, "--prefixes", f"{A},{B}",
                          "--metrics-port", str(port)])
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        w.start()
        # entries that are not jobs: each goes to its own tenant's DLQ, one of A's, two of B's
        for prefix, n in ((A, 1), (B, 2)):
            for i in range(n):
                r.xadd(Keys(prefix).jobs(MODEL, "interactive"),
                       {"job": f"bad-{i}", "body": "{not json"})
        want = {A: 1, B: 2}
        r.sadd(Keys(B).models, "retired")  # a model once served under B, no worker now

        def both_dlqs():  # the gauges are read every 5 s
            s = queue_samples(port)
            got = {p: s.get(("pagedq:dlq_size", p, MODEL, "interactive")) for p in want}
            return s if got == want else None
        s = until(both_dlqs, "each prefix's DLQ size on /metrics", 30, 0.2)
        assert {key[1] for key in s} == {A, B}
        for name in QUEUE_GAUGES:  # every gauge: a series per prefix and lane, no sum
            for prefix in (A, B):
                for lane in ("interactive", "batch"):
                    assert (name, prefix, MODEL, lane) in s, (name, prefix, lane)
        assert s["pagedq:dlq_size", A, MODEL, "batch"] == 0
        assert s["pagedq:pending_count", B, MODEL, "interactive"] == 0  # acknowledged
        # live workers per model seen under each prefix: this one; none for "retired"
        live = {k[1]: v for k, v in all_samples(port).items()
                if k[0] == "pagedq:model_workers"}
        assert live == {(("model", MODEL), ("prefix", A)): 1,
                        (("model", MODEL), ("prefix", B)): 1,
                        (("model", "retired"), ("prefix", B)): 0}, live
    finally:
        w.stop()
        r.close()


def all_samples(port: int) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, from the worker's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        body = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(body) for s in fam.samples}


def test_a_fresh_worker_exports_every_label_set_at_zero_before_any_job(redis_server,
                                                                        tiny_dir):
    """Series made at their first event hide that event from rate() and increase(): every
    lane's, status's and finish reason's series is there, at 0, before the first job."""
    from pagedq.producer import Client
    from pagedq.wire.settings import Settings
    from pagedq.worker.metrics import OUTCOMES

    port = free_port()
    w = WorkerProc(redis_server.url, A, model=tiny_dir,
                   extra=["--served-name", MODEL, "--metrics-port", str(port)])
    try:
        w.start()
        s = all_samples(port)
        for lane in ("interactive", "batch"):
            for hist in ("time_to_first_token_seconds", "request_queue_time_seconds",
                         "submission_to_first_token_seconds"):
                assert s[f"pagedq:{hist}_count", (("lane", lane),)] == 0, (hist, lane)
            for name in QUEUE_GAUGES:
                assert (name, (("lane", lane), ("model", MODEL), ("prefix", A))) in s
        tenant = (("model", MODEL), ("prefix", A))
        for status, reason in OUTCOMES:
            key = ("pagedq:request_success_total",
                   (("finish_reason", reason), ("model", MODEL), ("prefix", A),
                    ("status", status)))
            assert s[key] == 0, key
        for hist in ("request_prompt_tokens", "request_generation_tokens"):
            assert s[f"pagedq:{hist}_count", tenant] == 0, hist
        with Client(settings=Settings(redis_url=redis_server.url, prefix=A,
                                      model=MODEL)) as c:
            jid = c.submit("hello", max_tokens=3, temperature=0.0, ignore_eos=True)
            assert c.result(jid, timeout=60).status == "finished"
        length = ("pagedq:request_success_total", (("finish_reason", "length"), *tenant,
                                                   ("status", "finished")))
        # counted by the publisher thread after the result is committed
        s = until(lambda: (lambda s: s if s[length] == 1 else None)(all_samples(port)),
                  "the job counted", 15, 0.1)
        assert sum(v for (name, _), v in s.items()
                   if name == "pagedq:request_success_total") == 1  # the same series
        lane = (("lane", "interactive"),)
        assert s["pagedq:time_to_first_token_seconds_count", lane] == 1
        # the user's wait: the queue wait, then the engine's time to first token
        assert s["pagedq:submission_to_first_token_seconds_count", lane] == 1
        assert s["pagedq:request_generation_tokens_sum", tenant] == 3  # ignore_eos
        assert s["pagedq:request_generation_tokens_count", tenant] == 1
        # its phases: prefill = the engine's time to first token; decode after it, > 0
        assert s["pagedq:request_prefill_time_seconds_sum", ()] == pytest.approx(
            s["pagedq:time_to_first_token_seconds_sum", lane], abs=1e-9)
        assert s["pagedq:request_decode_time_seconds_count", ()] == 1
        assert s["pagedq:request_decode_time_seconds_sum", ()] > 0
        assert s["pagedq:request_prompt_tokens_count", tenant] == 1
        assert s["pagedq:request_prompt_tokens_sum", tenant] == \
            s["pagedq:prompt_tokens_total", ()]
        # observed about once a second: its one prompt looked up, no hit (nothing before it)
        s = until(lambda: (lambda s: s if s["pagedq:prefix_cache_queries_total", ()] else None)(
            all_samples(port)), "the prefix cache's queries", 15, 0.1)
        assert s["pagedq:prefix_cache_queries_total", ()] == s["pagedq:prompt_tokens_total", ()]
        assert s["pagedq:prefix_cache_hits_total", ()] == 0
        assert s["pagedq:submission_to_first_token_seconds_sum", lane] == pytest.approx(
            s["pagedq:request_queue_time_seconds_sum", lane]
            + s["pagedq:time_to_first_token_seconds_sum", lane], abs=1e-6)
    finally:
        w.stop()
