"""Bulk batches end to end: a real redis-server, a real rq worker process (`pagedq batch
worker`, killed with real signals) and a real pagedq worker serving a tiny random Llama
(tests/tiny_service.py). Nothing is mocked; every wait is on a condition with a deadline."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import redis

from pagedq.batch import Batches, BatchSettings, BatchStateError
from pagedq.batch.lines import job_id
from pagedq.cli import main as client_main
from pagedq.wire.settings import Settings
from pagedq.worker.redis_server import RedisServer
from tests.tiny_service import MODEL
from tests.waiting import until
from tests.worker_proc import ROOT, WorkerProc

PREFIX = "rel"  # tests/tiny_service.py's
# at the service's 0.02 s a step, a round of LONG_TOKENS-token jobs takes over 0.3 s
LONG_TOKENS = 16
FAST = {"PAGEDQ_BATCH_POLL_S": "0.2", "PAGEDQ_BATCH_LEASE_S": "2",
        "PAGEDQ_BATCH_EXPIRY_GRACE_S": "1"}


class RqWorker:
    """`pagedq batch worker` as a subprocess (rq SimpleWorker + its scheduler child)."""

    def __init__(self, url: str, batch_dir: Path, env: dict[str, str] | None = None) -> None:
        self.url, self.env = url, {**FAST, "PAGEDQ_BATCH_DIR": str(batch_dir), **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.log_path = tempfile.mktemp(prefix="pagedq-rq-", suffix=".log")

    def start(self) -> RqWorker:
        self.name = f"rq-{os.urandom(4).hex()}"
        cmd = [sys.executable, "-m", "pagedq", "--redis-url", self.url, "batch", "worker",
               "--prefix", PREFIX, "--name", self.name]
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT,
                                     env={**os.environ, "PYTHONPATH": ROOT, **self.env})
        from rq import Worker
        conn = redis.Redis.from_url(self.url)
        until(lambda: self.proc.poll() is not None or self.name in {
            w.name for w in Worker.all(connection=conn)}, "the rq worker registered", 60, 0.05)
        conn.close()
        assert self.proc.poll() is None, self.log()
        return self

    def children(self) -> list[int]:
        pids = []
        for task in Path(f"/proc/{self.proc.pid}/task").glob("*"):
            try:
                pids += [int(x) for x in (task / "children").read_text().split()]
            except OSError:
                pass
        return pids

    def kill(self) -> None:
        """SIGKILL the worker and the scheduler process it forked (a crashed machine)."""
        kids = self.children()
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        for pid in kids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            kids = self.children()
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            for pid in kids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self._log.close()

    def log(self) -> str:
        return Path(self.log_path).read_text(errors="replace")[-4000:]


@pytest.fixture(scope="module")
def service(tiny_dir, tmp_path_factory):
    """One redis-server, one pagedq worker (steps slowed a little, so that a test can catch
    a batch midway) and one rq worker on the default queue, for the whole module."""
    srv = RedisServer().start()
    batch_dir = tmp_path_factory.mktemp("batches")
    w = WorkerProc(srv.url, PREFIX, model=tiny_dir,
                   extra=["--served-name", MODEL, "--max-num-seqs", "16"],
                   env={"PAGEDQ_LEASE_S": "2", "PAGEDQ_HEARTBEAT_TTL_S": "3",
                        "PAGEDQ_FAILPOINTS": "step_sleep_s=0.02"})
    rq = None
    try:
        w.start()
        rq = RqWorker(srv.url, batch_dir).start()
        yield srv, w, batch_dir
    finally:
        if rq:
            rq.stop()
        w.stop(10)
        srv.cleanup()


@pytest.fixture
def env(service):
    """The shared service, plus rq workers on a queue of the test's own (started by it)."""
    srv, worker, batch_dir = service
    started: list[RqWorker] = []

    class Env:
        url, dir, pagedq_worker = srv.url, batch_dir, worker

        def rq(self, queue: str, **extra_env: str) -> RqWorker:
            w = RqWorker(self.url, self.dir, {"PAGEDQ_BATCH_QUEUE": queue, **extra_env})
            started.append(w.start())
            return w

        def batches(self, **settings) -> Batches:
            return Batches(self.url, prefix=PREFIX, model=MODEL,
                           settings=Settings(redis_url=self.url, prefix=PREFIX, model=MODEL),
                           batch_settings=BatchSettings(batch_dir=str(self.dir), **settings))

    yield Env()
    for w in started:
        w.stop()
    worker.signal(signal.SIGCONT)  # whatever the test did


def write_input(path: Path, n: int, bad: bool = True, max_tokens: int = 3,
                fail: bool = False, long_from: int | None = None) -> tuple[set, set]:
    """n valid lines (completions and chat, one with n=2, two with logprobs), plus one
    that fails (``fail``) and invalid lines of every kind (``bad``); lines from
    ``long_from`` on ask for LONG_TOKENS tokens. Returns (valid custom_ids, invalid line
    numbers)."""
    rows, valid = [], set()
    for i in range(n):
        cid = f"req-{i}"
        if long_from is not None and i >= long_from:
            max_tokens = LONG_TOKENS
        if i % 3 == 0:
            body = {"messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": max_tokens,
                    "temperature": 0}
            url = "/v1/chat/completions"
        else:
            body = {"prompt": f"count {i}", "max_completion_tokens": max_tokens, "seed": i}
            url = "/v1/completions"
        if i == 1:
            body["n"] = 2
        if i == 2:
            body["logprobs"] = 2
        if i == 3:
            body.update(logprobs=True, top_logprobs=2)
        if i == 4:
            body["model"] = MODEL
        rows.append(json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body}))
        valid.add(cid)
    invalid_lines = set()
    if fail:  # valid, but longer than the tiny model's context: the job fails
        rows.append(json.dumps({"custom_id": "too-long", "method": "POST",
                                "url": "/v1/completions", "body": {"prompt": "x" * 400}}))
        valid.add("too-long")
    if bad:
        bad_rows = [
            "{not json",
            json.dumps({"custom_id": "req-0", "method": "POST", "url": "/v1/completions",
                        "body": {"prompt": "dup"}}),
            json.dumps({"custom_id": "x-method", "method": "GET", "url": "/v1/completions",
                        "body": {"prompt": "a"}}),
            json.dumps({"custom_id": "x-url", "method": "POST", "url": "/v1/embeddings",
                        "body": {"input": "a"}}),
            json.dumps({"custom_id": "x-model", "method": "POST", "url": "/v1/completions",
                        "body": {"prompt": "a", "model": "gpt-4o"}}),
            json.dumps({"custom_id": "x-tokens", "method": "POST", "url": "/v1/completions",
                        "body": {"prompt": "a", "max_tokens": 0}}),
            json.dumps({"custom_id": "x-field", "method": "POST", "url": "/v1/chat/completions",
                        "body": {"messages": [{"role": "user", "content": "a"}],
                                 "functions": []}}),
            json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "a"}}),
        ]
        for k, row in enumerate(bad_rows):
            pos = 5 + k * (len(rows) // len(bad_rows))
            rows.insert(pos, row)
        invalid_lines = {i + 1 for i, row in enumerate(rows) if row in bad_rows}
    path.write_text("\n".join(rows) + "\n")
    return valid, invalid_lines


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def check_once(out: list[dict], err: list[dict], valid: set, invalid_lines: set) -> None:
    """Every valid custom_id exactly once across output and errors; invalid lines once."""
    ids = [r["custom_id"] for r in out] + [r["custom_id"] for r in err
                                           if "line" not in r["error"]]
    assert sorted(ids) == sorted(valid), "a request lost or written twice"
    assert sorted(r["error"]["line"] for r in err if "line" in r["error"]) == \
        sorted(invalid_lines)


def cli(*argv: str, capsys) -> tuple[int, str, str]:
    code = client_main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_batch_completes_counts_exact_every_custom_id_once(env, tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    valid, invalid = write_input(src, 300, fail=True)
    code, out, err = cli("--redis-url", env.url, "batch", "submit", str(src), "--model", MODEL,
                         "--prefix", PREFIX, "--batch-dir", str(env.dir), "--timeout", "90",
                         capsys=capsys)
    assert code == 0, err
    batch_id = out.strip()
    assert "completed" in err and "[" in err  # the progress bar, on stderr
    code, out, _ = cli("batch", "status", batch_id, "--redis-url", env.url, "--prefix", PREFIX,
                       capsys=capsys)
    b = json.loads(out)
    assert code == 0 and b["status"] == "completed" and b["object"] == "batch"
    assert b["request_counts"] == {"total": 309, "completed": 300, "failed": 9}
    assert b["invalid"] == 8 and b["jobs"] == {"finished": 300, "failed": 1}
    assert b["completed_at"] >= b["finalizing_at"] >= b["in_progress_at"] >= b["created_at"]
    res, errs = tmp_path / "res.jsonl", tmp_path / "err.jsonl"
    code, _, _ = cli("--redis-url", env.url, "--prefix", PREFIX, "batch", "results", batch_id,
                     "-o", str(res), "--errors", str(errs), capsys=capsys)
    assert code == 0
    out_rows, err_rows = read_jsonl(res), read_jsonl(errs)
    check_once(out_rows, err_rows, valid, invalid)
    assert {r["error"]["code"] for r in err_rows} == {
        "invalid_json_line", "duplicate_custom_id", "invalid_method", "invalid_url",
        "model_mismatch", "invalid_request", "invalid_custom_id", "job_failed"}
    by_id = {r["custom_id"]: r for r in out_rows}
    chat, comp = by_id["req-0"]["response"], by_id["req-2"]["response"]
    assert chat["status_code"] == 200 and chat["request_id"] == job_id(batch_id, 1)
    assert chat["body"]["object"] == "chat.completion"
    assert chat["body"]["choices"][0]["message"]["role"] == "assistant"
    assert comp["body"]["object"] == "text_completion"
    assert comp["body"]["choices"][0]["finish_reason"] in ("stop", "length")
    u = comp["body"]["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] > 0
    assert len(by_id["req-1"]["response"]["body"]["choices"]) == 2  # n=2
    lp = comp["body"]["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == u["completion_tokens"] and len(lp["top_logprobs"][0]) <= 2
    assert by_id["req-3"]["response"]["body"]["choices"][0]["logprobs"]["content"]
    # nothing large kept in Redis: the done list is gone, no input copy
    r = redis.Redis.from_url(env.url, decode_responses=True)
    assert not r.exists(env.batches().client.keys.batch_done(batch_id))
    # rq info (JSON serializer) shows the control-plane queue
    info = subprocess.run([os.path.join(os.path.dirname(sys.executable), "rq"), "info", "--url",
                           env.url, "-S", "rq.serializers.JSONSerializer"],
                          capture_output=True, text=True, timeout=60)
    assert info.returncode == 0 and "pagedq-batch" in info.stdout, info.stdout + info.stderr
    # retry: a new batch of the failed line only, linked to the old one
    code, out, err = cli("--redis-url", env.url, "--prefix", PREFIX, "batch", "retry", batch_id,
                         "--timeout", "60", "--batch-dir", str(env.dir), capsys=capsys)
    assert code == 0, err
    again = env.batches().retrieve(out.strip())
    assert again.retry_of == batch_id and again.request_counts.total == 1
    assert [r["custom_id"] for r in env.batches().errors(again.id)] == ["too-long"]
    code, out, _ = cli("--redis-url", env.url, "--prefix", PREFIX, "batch", "list", capsys=capsys)
    assert code == 0 and [json.loads(x)["id"] for x in out.splitlines()][:2] == [again.id, batch_id]


def test_partial_results_live_status_then_cancel(env, tmp_path, capsys):
    w = env.pagedq_worker
    src = tmp_path / "in.jsonl"
    # long lines after the first 30: the batch is surely midway when the worker is frozen
    valid, _ = write_input(src, 200, bad=False, max_tokens=4, long_from=30)
    with env.batches() as bt:
        b = bt.create(src)
        until(lambda: bt.retrieve(b.id).request_counts.completed >= 20, "20 requests done")
        w.signal(signal.SIGSTOP)  # freeze the service mid-batch
        try:
            mid = bt.retrieve(b.id)
            assert mid.status == "in_progress" and 20 <= mid.request_counts.completed < 200
            code, out, _ = cli("--redis-url", env.url, "--prefix", PREFIX, "batch", "status",
                               b.id, capsys=capsys)
            live = json.loads(out)["request_counts"]
            assert code == 0 and live["total"] == 200 and live["completed"] >= 20
            partial = until(lambda: [r for r in bt.results(b.id)] if len(
                list(bt.results(b.id))) >= 20 else None, "20 partial results in the file")
            assert {r["custom_id"] for r in partial} <= valid
            code, out, _ = cli("--redis-url", env.url, "--prefix", PREFIX, "batch", "cancel",
                               b.id, capsys=capsys)
            assert code == 0 and out.strip() == "cancelling"
        finally:
            w.signal(signal.SIGCONT)
        end = bt.wait(b.id, timeout=120)
        assert end.status == "cancelled" and end.cancelled_at and end.cancelling_at
        out_rows, err_rows = list(bt.results(end.id)), list(bt.errors(end.id))
        check_once(out_rows, err_rows, valid, set())
        assert len(out_rows) >= len(partial)  # what finished stays
        assert {r["error"]["code"] for r in err_rows} == {"batch_cancelled"}
        assert end.request_counts.completed == len(out_rows) < 200
        # queued jobs never started: only those running at the cancel have a start time
        r = bt.client.redis
        started = sum(1 for n in range(1, 201) if r.hget(bt.client.keys.job(job_id(b.id, n)),
                                                       "started_at"))
        assert started <= len(out_rows) + 16  # 16 = the worker's --max-num-seqs
        code, _, err = cli("--redis-url", env.url, "--prefix", PREFIX, "batch", "cancel", b.id,
                           capsys=capsys)
        assert code == 1 and "cancelled" in err


def test_window_runs_out_expired_then_retry_of_the_expired_lines(env, tmp_path):
    w = env.pagedq_worker
    # a queue of its own, with a long grace: the service expires the jobs by their deadline
    env.rq("win", PAGEDQ_BATCH_EXPIRY_GRACE_S="30")
    src = tmp_path / "in.jsonl"
    # ten short lines, then long ones: at 16 seats and 0.02 s a step the long ones need
    # seven rounds of over 0.3 s each, so most are still queued when the worker is frozen
    # after the first few short ones (the assertions do not depend on the machine's speed)
    valid, _ = write_input(src, 120, bad=False, max_tokens=4, long_from=10)
    with env.batches(batch_queue="win") as bt:
        b = bt.create(src, completion_window="5s")
        until(lambda: bt.retrieve(b.id).request_counts.completed >= 5, "5 requests done")
        w.signal(signal.SIGSTOP)
        try:
            secs = lambda: float(".".join(map(str, bt.client.redis.time())))  # noqa: E731
            until(lambda: secs() > bt.retrieve(b.id).expires_at + 0.5, "the window's end", 30)
        finally:
            w.signal(signal.SIGCONT)
        end = bt.wait(b.id, timeout=120)
        assert end.status == "expired" and end.expired_at
        out_rows, err_rows = list(bt.results(b.id)), list(bt.errors(b.id))
        check_once(out_rows, err_rows, valid, set())
        assert {r["error"]["code"] for r in err_rows} == {"batch_expired"}
        assert end.jobs.get("expired", 0) >= 1  # queued past the deadline: status expired
        assert end.request_counts.completed == len(out_rows) >= 5
        assert end.request_counts.failed == len(err_rows) == 120 - len(out_rows)

        again = bt.retry(b.id, completion_window="1h")
        assert again.retry_of == b.id and again.id != b.id
        done = bt.wait(again.id, timeout=180)
        assert done.status == "completed"
        assert done.request_counts.total == len(err_rows) == done.request_counts.completed
        assert {r["custom_id"] for r in bt.results(again.id)} == {r["custom_id"]
                                                                  for r in err_rows}


def test_ingest_killed_mid_fan_out_and_restarted_loses_and_doubles_nothing(env, tmp_path):
    # its own queue and rq workers; a small queue cap makes the ingest wait on backpressure,
    # so the fan-out takes a while
    caps = dict(PAGEDQ_MAX_QUEUED_JOBS="16", PAGEDQ_BATCH_CHUNK_LINES="5",
                PAGEDQ_BATCH_LEASE_S="1")
    rqw = env.rq("kill", **caps)
    src = tmp_path / "in.jsonl"
    valid, invalid = write_input(src, 150)
    with env.batches(batch_queue="kill") as bt:
        b = bt.create(src)
        rec = lambda: bt.store.get(b.id)  # noqa: E731
        until(lambda: int(rec().get("cursor") or 0) > 40, "the fan-out under way")
        rqw.kill()
        h = rec()
        assert h.get("ingested") != "1" and int(h["submitted"]) < 150, "fan-out ended early"
        env.rq("kill", **caps)
        end = bt.wait(b.id, timeout=90)
        assert end.status == "completed", rec()
        out_rows, err_rows = list(bt.results(b.id)), list(bt.errors(b.id))
        check_once(out_rows, err_rows, valid, invalid)
        assert len(out_rows) == 150 == end.request_counts.completed
        # each line made exactly one job, each ended once (the service's exact counters)
        h = rec()
        assert (h["submitted"], h["completed"], h.get("failed", "0")) == ("150", "150", "0")
        raw = [json.loads(x) for x in Path(end.output_file).read_text().splitlines()]
        assert len(raw) == 150  # the final file holds no duplicate


def test_async_api_and_bad_input(env, tmp_path):
    import asyncio

    from pagedq.batch import AsyncBatches
    from pagedq.wire.errors import InvalidRequest

    src = tmp_path / "in.jsonl"
    valid, _ = write_input(src, 10, bad=False)

    async def go():
        async with AsyncBatches(env.url, prefix=PREFIX, model=MODEL,
                                batch_settings=BatchSettings(batch_dir=str(env.dir))) as ab:
            b = await ab.create(src, metadata={"team": "a"})
            end = await ab.wait(b.id, timeout=60)
            assert end.status == "completed" and end.metadata == {"team": "a"}
            assert {r["custom_id"] for r in await ab.results(b.id)} == valid
            assert (await ab.list())[0].id == b.id
            return b.id
    asyncio.run(go())
    with env.batches(batch_max_lines=5) as bt:
        with pytest.raises(InvalidRequest, match="more than the limit of 5 lines"):
            bt.create(src)
        with pytest.raises(InvalidRequest, match="completion_window"):
            bt.create(src, completion_window="forever")
        assert not list(env.dir.glob("batch_*/input.jsonl.tmp"))
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"custom_id": "a"}\nnot json\n')
        with env.batches() as bt2:
            b = bt2.create(bad)
            end = bt2.wait(b.id, timeout=30)
        assert end.status == "failed" and end.errors["data"][0]["line"] == 1
        assert end.request_counts.model_dump() == {"total": 2, "completed": 0, "failed": 2}


def test_total_is_set_at_submit_and_counts_move_during_ingest(env, tmp_path):
    """request_counts.total is the file's line count from the start (not 0 while
    validating); ``checked`` and ``submitted`` show the ingest's progress."""
    src = tmp_path / "in.jsonl"
    valid, invalid_lines = write_input(src, 2000, max_tokens=1)
    n = len(valid) + len(invalid_lines)
    with env.batches() as bt:
        b = bt.create(src)
        assert b.status == "validating" and b.request_counts.total == n
        seen = []

        def ingested():
            x = bt.retrieve(b.id)
            assert x.request_counts.total == n, x
            seen.append((x.checked, x.submitted))
            return x.submitted == len(valid)
        until(ingested, "every valid line submitted", 120)
        assert seen[-1] == (n, len(valid))
        assert all(a <= c and s <= d for (a, s), (c, d) in zip(seen, seen[1:], strict=False))
        with contextlib.suppress(BatchStateError):  # (unless it is over already)
            bt.cancel(b.id)
        assert bt.wait(b.id, timeout=120).request_counts.total == n


def test_a_small_batch_after_a_large_one_shares_the_lane(env, tmp_path):
    """Each batch keeps at most PAGEDQ_BATCH_WINDOW_JOBS jobs on the lane, so a small batch
    submitted after a large one runs beside it: it ends while the large one still runs
    (one after the other, it would end after all of the large one's lines)."""
    queue = "fair-" + os.urandom(3).hex()
    env.rq(queue, PAGEDQ_BATCH_WINDOW_JOBS="24")
    big, small = tmp_path / "big.jsonl", tmp_path / "small.jsonl"
    write_input(big, 300, bad=False, max_tokens=LONG_TOKENS)
    write_input(small, 20, bad=False, max_tokens=LONG_TOKENS)
    with env.batches(batch_queue=queue) as bt:
        a = bt.create(big)
        until(lambda: bt.retrieve(a.id).request_counts.completed >= 10, "the large one runs")
        b = bt.create(small)
        end_b = bt.wait(b.id, timeout=240)
        a_then = bt.retrieve(a.id)
        assert end_b.status == "completed" and end_b.request_counts.completed == 20
        assert not a_then.done and a_then.request_counts.completed < 300 - 20, a_then
        assert a_then.submitted < 300  # the large one's window held the rest back
        end_a = bt.wait(a.id, timeout=240)
        assert end_a.status == "completed" and end_a.request_counts.completed == 300


def alive(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def test_the_rq_scheduler_leaves_with_its_worker_after_kill_9(env):
    """kill -9 of `pagedq batch worker` alone: its scheduler child ends too and gives the
    scheduler lock up, so a restarted worker's scheduler takes over at once."""
    queue = "sched-" + os.urandom(3).hex()
    lock = f"rq:scheduler-lock:{queue}"
    conn = redis.Redis.from_url(env.url)
    w = env.rq(queue)
    kids = until(lambda: w.children() if conn.exists(lock) else None,
                 "the scheduler child holds its lock", 60, 0.05)
    w.proc.send_signal(signal.SIGKILL)
    w.proc.wait(30)
    until(lambda: not any(map(alive, kids)), "the scheduler ended", 15, 0.05)
    until(lambda: not conn.exists(lock), "the scheduler lock given up", 15, 0.05)
    env.rq(queue)
    until(lambda: conn.exists(lock), "the new worker's scheduler took the lock", 30, 0.05)
    conn.close()
