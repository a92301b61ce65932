"""``pagedq inspect`` and ``pagedq dlq list|requeue`` against a real redis-server and real
tiny workers (tests/tiny_service.py's model). One module-wide service: a worker that
crashes on a poison prompt, then a healthy one that dead-letters it (max_deliveries=1)
and serves everything after."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest

from pagedq.admin.dlq import (
    BODY_CHARS,
    DLQ_ENTRY,
    REQUEUED_FROM,
    DeadEntry,
    NotRequeueable,
    new_ids,
    read,
    request_of,
)
from pagedq.cli import main
from pagedq.producer import Client
from pagedq.producer.requests import validate_request
from pagedq.wire.scripts import req_hash
from pagedq.wire.settings import Settings
from pagedq.worker.redis_server import RedisServer
from tests.tiny_service import MODEL
from tests.worker_proc import ROOT, WorkerProc

PREFIX = "insp"
BASE_ENV = {"PAGEDQ_LEASE_S": "2", "PAGEDQ_HEARTBEAT_TTL_S": "3",
            "PAGEDQ_DRAIN_TIMEOUT_S": "1", "PAGEDQ_MAX_DELIVERIES": "1"}


def wait_for(cond: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := cond():
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


class Svc:
    def __init__(self, url: str, tiny_dir: str) -> None:
        self.url, self.tiny_dir = url, tiny_dir
        self.c = Client(settings=Settings(redis_url=url, prefix=PREFIX, model=MODEL))
        self.workers: list[WorkerProc] = []

    def worker(self, worker_id: str, env: dict[str, str], wait: bool = True) -> WorkerProc:
        w = WorkerProc(self.url, PREFIX, model=self.tiny_dir, worker_id=worker_id,
                       extra=["--served-name", MODEL, "--max-num-seqs", "16"],
                       env={**BASE_ENV, **env})
        self.workers.append(w)
        return w.start(wait=wait)

    def cli(self, capsys, *argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main(["--redis-url", self.url, "--prefix", PREFIX, *argv])
        out, err = capsys.readouterr()
        return code, out, err

    def inspect(self, capsys, *argv: str) -> dict[str, Any]:
        code, out, err = self.cli(capsys, "inspect", "--json", *argv)
        assert code == 0, err
        return json.loads(out)

    def dlq(self) -> list[tuple[str, dict[str, str]]]:
        return self.c.redis.xrange(self.c.keys.dlq(MODEL))


@pytest.fixture(scope="module")
def svc(tiny_dir):
    srv = RedisServer().start()
    s = Svc(srv.url, tiny_dir)
    try:
        crashy = s.worker("crashy", {"PAGEDQ_FAILPOINTS": "crash_on_prompt=POISON"})
        s.poison = s.c.submit("POISON pill", max_tokens=5, ignore_eos=True,
                              metadata={"origin": "test"})
        wait_for(lambda: crashy.proc.poll() is not None, "the poisoned worker to die")
        # the healthy worker claims the entry after the lease; its 2nd start is poison
        s.healthy = s.worker("healthy", {"PAGEDQ_FAILPOINTS": "step_sleep_s=0.1"})
        jobs = s.c.keys.jobs(MODEL)
        s.c.redis.xadd(jobs, {"job": "rawbad", "body": "[1, 2]"})
        big = {"id": "trunc", "prompt": "x" * 5000, "max_tokens": 0}  # invalid, > BODY_CHARS
        s.c.redis.xadd(jobs, {"job": "trunc", "body": json.dumps(big)})
        wait_for(lambda: len(s.dlq()) == 3, "three dead letters")
        yield s
    finally:
        for w in s.workers:
            w.stop(10)
        s.c.close()
        srv.cleanup()


def lane(snap: dict[str, Any], name: str) -> dict[str, Any]:
    (m,) = [m for m in snap["models"] if m["model"] == MODEL]
    (ln,) = [x for x in m["lanes"] if x["lane"] == name]
    return ln


def test_dlq_list_shows_reasons_and_what_can_be_requeued(svc, capsys):
    code, out, _ = svc.cli(capsys, "dlq", "list", "--json")
    assert code == 0
    by_job = {d["job"]: d for d in json.loads(out)}
    assert set(by_job) == {svc.poison, "rawbad", "trunc"}
    p = by_job[svc.poison]
    assert "poison" in p["reason"] and p["requeueable"] and p["problem"] is None
    assert p["lane"] == "interactive" and p["model"] == MODEL and p["age_s"] >= 0
    assert json.loads(p["body"])["prompt"] == "POISON pill"
    assert (by_job["rawbad"]["requeueable"], by_job["rawbad"]["problem"]) == (False, "not_json")
    assert by_job["trunc"]["problem"] == "truncated"
    assert len(by_job["trunc"]["body"]) == BODY_CHARS
    code, out, _ = svc.cli(capsys, "dlq", "list", "--lane", "interactive", "--model", MODEL)
    assert code == 0 and out.splitlines()[0].split()[:4] == ["MODEL", "LANE", "ENTRY", "JOB"]
    row = next(line for line in out.splitlines() if svc.poison in line)
    assert "poison job" in row and " yes " in row
    assert "no: truncated" in out and "no: not_json" in out
    code, out, _ = svc.cli(capsys, "dlq", "list", "--lane", "batch")
    assert (code, out) == (0, "no dead letters\n")


def test_inspect_shows_queue_pending_ages_and_workers_while_frozen(svc, capsys):
    c = svc.c
    long_job = c.submit("a long one", max_tokens=200, ignore_eos=True)
    snap = wait_for(lambda: (s := svc.inspect(capsys)) and any(
        long_job in w["jobs"] for w in s["workers"]) and s, "the worker to list its job")
    (w,) = [w for w in snap["workers"] if w["worker"] == "healthy"]
    assert (w["model"], w["device"], w["max_num_seqs"], w["serving"]) == (MODEL, "cpu", 16, True)
    assert w["running"] == 1 and w["jobs"] == [long_job] and 0 <= w["kv_usage"] < 1
    assert w["beat_s"] < 3 and w["uptime_s"] > 0
    svc.healthy.signal(signal.SIGSTOP)
    try:
        queued = [c.submit(f"q{i}", max_tokens=3) for i in range(3)]
        bulk = [c.submit(f"b{i}", max_tokens=3, lane="batch") for i in range(2)]
        # frozen: its entry stays pending and ages, its heartbeat key expires
        snap = wait_for(lambda: (s := svc.inspect(capsys, "--model", MODEL))
                        and lane(s, "interactive")["oldest_pending"]
                        and lane(s, "interactive")["oldest_pending"][0]["idle_s"] >= 3
                        and not s["workers"] and s, "an aged pending entry, a silent worker")
        inter, batch = lane(snap, "interactive"), lane(snap, "batch")
        assert (inter["queued"], inter["stream_length"], inter["pending"]) == (3, 4, 1)
        assert inter["pending_by_consumer"] == {"healthy": 1} and inter["queued_tokens"] > 0
        (p,) = inter["oldest_pending"]
        assert (p["job"], p["consumer"], p["deliveries"]) == (long_job, "healthy", 1)
        assert (batch["queued"], batch["stream_length"], batch["pending"]) == (2, 2, 0)
        assert inter["dlq_length"] == 3 and batch["dlq_length"] == 0
        assert {d["job"] for d in inter["dlq"]} == {svc.poison, "rawbad", "trunc"}
        assert "healthy" in {s["worker"] for s in snap["silent_workers"]}
        code, out, _ = svc.cli(capsys, "inspect")
        assert code == 0
        rows = {tuple(line.split()[:3]): line.split() for line in out.splitlines()}
        assert rows[(MODEL, "interactive", "3")][5] == "1"  # PENDING
        assert rows[(MODEL, "batch", "2")][7] == "0"  # DLQ
        assert "PENDING (oldest 5 per lane)" in out and long_job in out
        assert "DEAD LETTERS" in out and "no live worker" in out
    finally:
        svc.healthy.signal(signal.SIGCONT)
    c.cancel(long_job)
    for j in queued + bulk:
        assert c.result(j, timeout=60).status == "finished"
    assert c.result(long_job, timeout=60).status == "cancelled"


def test_requeue_submits_a_new_job_and_removes_the_entry_once(svc, capsys):
    c = svc.c
    (dead,) = [e for e in read(c.redis, c.keys, MODEL, "interactive") if e.job == svc.poison]
    code, out, err = svc.cli(capsys, "dlq", "requeue", svc.poison)
    assert (code, err) == (0, "")
    new = out.strip()
    assert new == f"{svc.poison}.r1"
    rec = c.result(new, timeout=60)
    assert rec.status == "finished" and rec.usage.completion_tokens == 5
    # the body SUBMIT got (its hash is on the record): the original request, a new id, and
    # where it came from in its metadata
    want = request_of(dead)
    assert want["prompt"] == "POISON pill" and want["max_tokens"] == 5
    assert want["metadata"] == {"origin": "test", REQUEUED_FROM: svc.poison,
                                DLQ_ENTRY: f"{MODEL}:interactive:{dead.id}"}
    body = validate_request({**want, "id": new}).body_json()
    assert c.redis.hget(c.keys.job(new), "req_hash") == req_hash(body)
    assert dead.id not in [i for i, _f in svc.dlq()]
    old = c.status(svc.poison)  # the dead job keeps its one result
    assert old.status == "failed" and "poison" in old.error
    for ident in (svc.poison, dead.id):  # twice: refused cleanly, nothing submitted
        code, out, err = svc.cli(capsys, "dlq", "requeue", ident)
        assert (code, out) == (3, "") and err.count("\n") == 1
        assert err.startswith("pagedq: no dead-letter entry with entry id or job id")
    assert not c.redis.exists(c.keys.job(f"{svc.poison}.r2"))


def test_requeue_is_idempotent_and_skips_ids_taken_by_other_requests(svc, capsys):
    # entries laid out as REJECT writes them (wire/lua/reject.lua), on the batch lane
    c, dlq_key = svc.c, svc.c.keys.dlq(MODEL, "batch")
    for job in ("cut", "taken"):
        body = json.dumps({"id": job, "model": MODEL, "lane": "batch", "prompt": "hi",
                           "max_tokens": 2})
        c.redis.xadd(dlq_key, {"entry": "1-0", "job": job, "reason": "test", "body": body,
                               "deliveries": "1", "at": f"{time.time():.6f}"})
    cut = [e for e in read(c.redis, c.keys, MODEL, "batch") if e.job == "cut"][0]
    # a requeue cut off after its SUBMIT, before its XDEL: run again, it finds its own job
    c.submit_request({**request_of(cut), "id": "cut.r1"})
    assert svc.cli(capsys, "dlq", "requeue", "cut", "--lane", "batch") == (0, "cut.r1\n", "")
    c.submit("another request", job_id="taken.r1", lane="batch", max_tokens=2)
    assert svc.cli(capsys, "dlq", "requeue", "taken") == (0, "taken.r2\n", "")
    assert c.redis.xlen(dlq_key) == 0 and not c.redis.exists(c.keys.job("cut.r2"))
    for j in ("cut.r1", "taken.r1", "taken.r2"):
        assert c.result(j, timeout=60).status == "finished"


def test_requeue_refuses_damaged_entries_and_bad_input(svc, capsys):
    code, out, err = svc.cli(capsys, "dlq", "requeue", "trunc")
    assert (code, out) == (2, "") and err.count("\n") == 1
    assert "trunc" in err and "incomplete" in err and str(BODY_CHARS) in err
    code, _, err = svc.cli(capsys, "dlq", "requeue", "rawbad", "trunc")
    assert code == 2 and err.count("\n") == 2 and "not a JSON object" in err
    code, out, err = svc.cli(capsys, "dlq", "requeue", "--all", "--model", MODEL)
    assert (code, out) == (2, "") and err.count("\n") == 2  # each refused, the rest tried
    assert {f["job"] for _i, f in svc.dlq()} == {"rawbad", "trunc"}  # kept
    assert svc.cli(capsys, "dlq", "requeue", "--all", "--model", MODEL, "--lane", "batch") == (
        0, "", "")  # nothing there
    assert not svc.c.redis.exists(svc.c.keys.job("trunc.r1"))
    cases = [(["dlq", "requeue", "bad id!"], 2), (["dlq", "requeue", "nope"], 3),
             (["dlq", "requeue", "--model", "nope", "trunc"], 3),
             (["dlq", "requeue", "--lane", "batch", "trunc"], 3),
             (["dlq", "list", "--model", "bad model"], 2), (["dlq", "list", "--lane", "B!"], 2),
             (["inspect", "--model", "nope"], 3), (["dlq", "requeue"], 2),
             (["dlq", "requeue", "--all"], 2)]
    for argv, want in cases:
        code, out, err = svc.cli(capsys, *argv)
        assert (code, out) == (want, ""), (argv, code, out, err)
        assert err.count("\n") == 1 and err.startswith("pagedq: "), (argv, err)
    code, _, err = svc.cli(capsys, "inspect", "--count", "0")
    assert code == 2 and "positive" in err


def _sigint_default() -> None:
    """In the child before exec: SIGINT at its default, so Python turns it into
    KeyboardInterrupt. A suite started in the background by a non-interactive shell inherits
    SIGINT ignored, and Python leaves an ignored SIGINT ignored (as a program should)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_watch_prints_a_document_per_interval_until_interrupted(svc):
    p = subprocess.Popen([sys.executable, "-m", "pagedq", "inspect", "--json", "--watch",
                          "0.2", "--redis-url", svc.url, "--prefix", PREFIX],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, text=True,
                         preexec_fn=_sigint_default)
    try:
        docs = [json.loads(p.stdout.readline()) for _ in range(2)]
        assert all(d["prefix"] == PREFIX and d["v"] == 1 for d in docs)
        assert docs[1]["at"] > docs[0]["at"]
    finally:
        p.send_signal(signal.SIGINT)
        try:
            assert p.wait(30) == 0
        finally:
            p.kill()  # no-op once it has exited; else not left behind


def test_worker_cli_registers_the_admin_commands():
    from pagedq.cli import build_parser
    args = build_parser().parse_args(["dlq", "requeue", "--all", "--model", "m", "--prefix", "x"])
    assert (args.all, args.model, args.prefix) == (True, "m", "x")
    assert build_parser().parse_args(["inspect", "--watch"]).watch == 2.0


# ---- the requeue rules on entries made here (no service needed)

def entry(job: str = "j1", body: dict | str | None = None, **kw: Any) -> DeadEntry:
    body = {"id": job, "prompt": "hi", "model": MODEL} if body is None else body
    text = body if isinstance(body, str) else json.dumps(body)
    return DeadEntry(MODEL, kw.get("lane", "interactive"), "1-0", job, "why", text, 1, 0.0, "")


@pytest.mark.parametrize("e, code", [
    (entry(body=json.dumps({"id": "j1", "prompt": "x" * BODY_CHARS})[:BODY_CHARS]), "truncated"),
    (entry(body="{\"id\": \"j1\", \"prompt\": \"\udcff\"}"), "not_utf8"),
    (entry(body={"id": "other", "prompt": "hi", "model": MODEL}), "mismatch"),
    (entry(body={"id": "j1", "prompt": "hi", "model": "m2"}), "mismatch"),
    (entry(body={"id": "j1", "prompt": "hi", "model": MODEL, "lane": "interactive"},
           lane="batch"), "mismatch"),
    (entry(body={"id": "j1", "prompt": "hi", "model": MODEL,
                 "metadata": {str(i): "v" for i in range(15)}}), "metadata_full"),
    (entry(job="j" * 126, body={"prompt": "hi", "model": MODEL}), "id_too_long"),
    (entry(job=""), "no_job"),
])
def test_unrequeueable_entries(e, code):
    with pytest.raises(NotRequeueable) as err:
        request_of(e)
    assert err.value.code == code


def test_requeue_request_and_ids():
    # no lane in the body: the stream's (as the worker reads it); OpenAI's user -> metadata
    req = request_of(entry(body={"prompt": "hi", "model": MODEL, "user": "u"}, lane="batch"))
    assert (req["lane"], req["model"], req["prompt"]) == ("batch", MODEL, "hi")
    assert req["metadata"] == {"user": "u", REQUEUED_FROM: "j1", DLQ_ENTRY: f"{MODEL}:batch:1-0"}
    ids = new_ids("a.b")
    assert [next(ids), next(ids)] == ["a.b.r1", "a.b.r2"]
    assert next(new_ids("a.r1")) == "a.r2" and next(new_ids("a.r9")) == "a.r10"


def test_body_chars_agree_with_the_worker():
    from pagedq.worker.admission import DLQ_BODY_CHARS
    assert BODY_CHARS == DLQ_BODY_CHARS
