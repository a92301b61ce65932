"""`pagedq demo` as a person sees it: through a pseudo-terminal (pexpect), its output played
into a terminal emulator (pyte) whose screen and scrollback are what a person would read at
the end: the worker's start line, each job's whole answer, one summary table. And
``--plain``: plain lines for logs and CI. Both against a redis-server of the test, whose
keys the demo must have removed when it ends. The real SmolLM2: the answers must make
sense ("Paris")."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import redis

from pagedq.demo_view import SUMMARY_TITLE
from tests.worker_proc import ROOT

pexpect = pytest.importorskip("pexpect")
pyte = pytest.importorskip("pyte")

ARGS = ["--jobs", "3", "--max-tokens", "10"]
ROWS, COLS = 40, 120
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][0-9A-B]|\r")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDQ_")}
    return {**env, "PYTHONPATH": ROOT, "TERM": "xterm-256color", "COLUMNS": str(COLS),
            "LINES": str(ROWS)}


def _screen_text(raw: bytes) -> list[str]:
    """The terminal's scrollback and screen after ``raw``, one string per row."""
    screen = pyte.HistoryScreen(COLS, ROWS, history=5000)
    pyte.ByteStream(screen).feed(raw)
    rows = [line for line in screen.history.top] + [screen.buffer[y] for y in range(ROWS)]
    text = ["".join(line[x].data for x in range(COLS)).rstrip() for line in rows]
    while text and not text[-1]:
        text.pop()
    return text


def test_live_view_through_a_terminal(redis_server):
    child = pexpect.spawn(sys.executable, ["-m", "pagedq", "demo", "--redis-url",
                                           redis_server.url, *ARGS],
                          cwd=ROOT, env=_env(), dimensions=(ROWS, COLS), timeout=600)
    chunks = []
    while True:
        try:
            chunks.append(child.read_nonblocking(65536, timeout=600))
        except pexpect.EOF:
            break
    child.wait()
    raw = b"".join(chunks)
    text = _screen_text(raw)
    screen = "\n".join(text)
    assert child.exitstatus == 0, screen
    plain = ANSI.sub("", raw.decode("utf-8", "replace"))
    assert "worker: loading smollm2" in plain, "no model-load progress was shown"
    # the final frame: the start line, every job finished with its whole answer
    assert screen.count("worker ready in") == 1, screen
    assert "model smollm2 on cpu" in screen
    for k, prompt in enumerate(["What is the capital of France?",
                                "Write a haiku about the sea.",
                                "Give three tips for learning Python."], 1):
        assert f"✓ job {k} {prompt}" in screen, screen
    assert "Paris" in screen
    assert screen.count(SUMMARY_TITLE) == 1, screen  # one table, after the view
    table = text[next(i for i, line in enumerate(text) if SUMMARY_TITLE in line):]
    assert sum(bool(re.match(r"│ [123] +│ finished", line)) for line in table) == 3, table
    assert any(line.startswith("│ all │ 3/3 finished") for line in table), table
    assert redis.Redis.from_url(redis_server.url).dbsize() == 0  # the demo's keys are gone


def test_plain_lines_for_logs(redis_server):
    r = subprocess.run([sys.executable, "-m", "pagedq", "demo", "--plain", "--redis-url",
                        redis_server.url, *ARGS], cwd=ROOT, env=_env(), capture_output=True,
                       text=True, timeout=600)
    out = r.stdout
    assert r.returncode == 0, (out, r.stderr)
    assert "\x1b" not in out and "\r" not in out
    lines = out.splitlines()
    assert any(line.startswith("worker: loading smollm2: ") for line in lines), out
    assert sum(line.startswith("worker: ready in ") for line in lines) == 1, out
    i = lines.index("[job 1] What is the capital of France?")
    assert "Paris" in lines[i + 1]
    assert sum(line.startswith("[job ") for line in lines) == 3
    assert out.count(SUMMARY_TITLE) == 1
    assert re.search(r"^  all +3/3 finished", out, re.M), out
    assert re.search(r"^removed the demo's \d+ Redis keys", out, re.M), out
    assert redis.Redis.from_url(redis_server.url).dbsize() == 0


def test_no_redis_named_an_embedded_one_whatever_answers_on_the_default_port(tiny_dir):
    """Without --redis-url or $PAGEDQ_REDIS_URL the demo starts its own redis-server and
    says so first, even when a Redis answers on the default port (it may be a shared one:
    on a machine where one does, the former fallback used it). The tiny model: the point
    is the Redis, not the answers."""
    r = subprocess.run([sys.executable, "-m", "pagedq", "demo", "--plain", "--model", tiny_dir,
                        "--served-name", "tiny", "--jobs", "1", "--max-tokens", "2"],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout, r.stderr)
    first = r.stdout.splitlines()[0]
    m = re.match(r"redis: redis://127\.0\.0\.1:(\d+)/0 \(embedded\); key prefix ", first)
    assert m and m[1] != "6379", first


def test_a_named_redis_that_does_not_answer_is_one_line_exit_78():
    from pagedq.worker.redis_server import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"
    for argv, env in ((["--redis-url", url], {}), ([], {"PAGEDQ_REDIS_URL": url})):
        r = subprocess.run([sys.executable, "-m", "pagedq", "demo", "--plain", *argv],
                           cwd=ROOT, env={**_env(), **env}, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 78, (r.stdout, r.stderr)
        assert r.stderr.strip() == (f"pagedq: no Redis answers at {url} (--redis-url or "
                                    "$PAGEDQ_REDIS_URL); leave both unset for an embedded one")
        assert r.stdout == ""
