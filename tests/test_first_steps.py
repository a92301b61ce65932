"""A worker's start as a person sees it (worker/startup.py) and `pagedq watch`
(pagedq/watch.py), against one tiny-model worker on a redis-server of this module."""
from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys

import pytest

from pagedq.producer import Client
from pagedq.worker.redis_server import RedisServer
from pagedq.worker.startup import StartReporter, parse_line
from tests.tiny_service import MODEL
from tests.worker_proc import ROOT, WorkerProc

PREFIX = "first"


@pytest.fixture(scope="module")
def service(tiny_dir):
    srv = RedisServer().start()
    w = WorkerProc(srv.url, PREFIX, model=tiny_dir, worker_id="fs-1",
                   extra=["--served-name", MODEL, "--max-num-seqs", "16"]).start()
    client = Client(srv.url, prefix=PREFIX, model=MODEL)
    yield srv, w, client
    client.close()
    w.stop(10)
    srv.cleanup()


def pagedq(srv, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDQ_")}
    return subprocess.run([sys.executable, "-m", "pagedq", "--redis-url", srv.url,
                           "--prefix", PREFIX, *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**env, "PYTHONPATH": ROOT})


# ---- the start line -------------------------------------------------------------------

def test_start_line_comes_before_the_json_logs_and_says_what_runs(service):
    _srv, w, _c = service
    lines = w.log(tail=None).splitlines()
    first_json = next(i for i, line in enumerate(lines) if line.startswith("{"))
    human = lines[:first_json]
    assert human and all(line.startswith("pagedq: ") for line in human), human
    assert [parse_line(line).kind for line in human] == ["loading"] * (len(human) - 1) + \
        ["ready"], human
    ready = human[-1]
    for part in ("worker fs-1", f"model {MODEL} on cpu, float32", "KV cache ", " blocks x 16 = ",
                 " tokens (", "max 16 seqs", "metrics off", f"prefix {PREFIX}"):
        assert part in ready, (part, ready)
    assert "loading weights to cpu float32" in "\n".join(human)
    json.loads(lines[first_json])  # then JSON logs


def test_start_reporter_on_a_terminal_rewrites_one_line():
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Tty()
    with StartReporter("m", out) as r:
        r.stage("reading")
        r.stage("loading weights")
    assert out.getvalue().count("\n") == 0 and out.getvalue().endswith("\r\033[K")
    assert parse_line(out.getvalue().split("\r\033[K")[-2]).text == "loading weights"
    out = Tty()
    with pytest.raises(RuntimeError), StartReporter("m", out) as r:
        r.stage("reading")
        raise RuntimeError("boom")
    assert out.getvalue().endswith("\r\033[K")  # an error message starts on a clean line


# ---- pagedq watch -----------------------------------------------------------------------

def test_watch_a_running_job_then_the_ended_one(service):
    srv, _w, c = service
    job = c.submit("hello watch", max_tokens=24, temperature=0, ignore_eos=True)
    live = pagedq(srv, "watch", job, "--plain", "--timeout", "60")
    rec = c.status(job)
    assert live.returncode == 0, live.stderr
    assert live.stdout == rec.text + "\n"
    assert re.fullmatch(rf"pagedq: job {job} finished \(length\) · 24 tokens · TTFT "
                        r"(\d+\.\d\d s|-) · (\d+\.\d tok/s|-) · \d+\.\d s since submit\n",
                        live.stderr), live.stderr
    again = pagedq(srv, "watch", job)  # not a terminal: plain by itself
    assert again.returncode == 0 and again.stdout == live.stdout
    assert "finished (length) · 24 tokens · TTFT - · " in again.stderr  # TTFT: seen live only


def test_watch_exit_codes(service):
    srv, _w, c = service
    missing = pagedq(srv, "watch", "no-such-job")
    assert missing.returncode == 3 and missing.stderr.strip() == \
        "pagedq: job not found: no-such-job", missing.stderr
    job = c.submit("to cancel", max_tokens=2000, ignore_eos=True)
    c.cancel(job)
    cancelled = pagedq(srv, "watch", job, "--plain")
    assert cancelled.returncode == 7, cancelled.stderr
    assert f"pagedq: job {job} cancelled" in cancelled.stderr


def test_watch_live_view_through_a_terminal(service):
    pexpect = pytest.importorskip("pexpect")
    from tests.test_demo import COLS, ROWS, _env, _screen_text

    srv, _w, c = service
    job = c.submit("hello live", max_tokens=16, temperature=0, ignore_eos=True)
    child = pexpect.spawn(sys.executable, ["-m", "pagedq", "--redis-url", srv.url,
                                           "--prefix", PREFIX, "watch", job],
                          cwd=ROOT, env=_env(), dimensions=(ROWS, COLS), timeout=120)
    raw = child.read()
    child.wait()
    screen = "\n".join(_screen_text(raw))
    assert child.exitstatus == 0, screen
    assert screen.count(f"╭─ job {job} ") == 1, screen  # one panel, redrawn in place
    assert "finished (length) · 16 tokens" in screen, screen  # its last frame
