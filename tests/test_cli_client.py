"""Client CLI (producer.cli.main) against a real redis-server, and the no-torch import rule."""
from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid

import pytest

from producer import Client
from producer.cli import main
from tests.test_producer import DELTAS, bg, play, write_final

MODEL = "m1"


@pytest.fixture
def c(shared_redis_server):
    with Client(shared_redis_server.url, prefix="c" + uuid.uuid4().hex[:10], model=MODEL) as cl:
        cl.url = shared_redis_server.url
        yield cl


def cli(c: Client, capsys, *argv: str) -> tuple[int, str, str]:
    """Run the client CLI (root options + subcommand) -> (exit code, stdout, stderr)."""
    code = main(["--redis-url", c.url, "--prefix", c.keys.prefix, *argv])
    out, err = capsys.readouterr()
    return code, out, err


def play_when_submitted(c: Client, job_id: str, deltas: list[str], **kw) -> None:
    deadline = time.monotonic() + 5
    while not c.redis.exists(c.keys.job(job_id)) and time.monotonic() < deadline:
        time.sleep(0.01)
    play(c, job_id, deltas, **kw)


def test_submit_status_result(c, capsys):
    code, out, _ = cli(c, capsys, "submit", "--model", MODEL, "--max-tokens", "7",
                       "--temperature", "0", "--top-p", "0.9", "--top-k", "5", "--seed", "3",
                       "--stop", "\n", "--stop", "END", "Hello there")
    jid = out.strip()
    assert code == 0 and c.redis.xlen(c.keys.jobs(MODEL)) == 1
    (_, fields), = c.redis.xrange(c.keys.jobs(MODEL))
    body = json.loads(fields["body"])
    assert body["id"] == jid and body["prompt"] == "Hello there" and body["stop"] == ["\n", "END"]
    assert (body["max_tokens"], body["top_k"], body["seed"], body["top_p"]) == (7, 5, 3, 0.9)
    code, out, _ = cli(c, capsys, "status", jid)
    assert code == 0 and json.loads(out)["status"] == "queued"
    t = bg(play, c, jid, DELTAS[:3], delay=0.05)
    code, out, _ = cli(c, capsys, "result", jid, "--timeout", "5")
    t.join()
    assert code == 0 and out == "".join(DELTAS[:3]) + "\n"


def test_submit_chat_and_idempotent_id(c, capsys):
    assert cli(c, capsys, "submit", "--model", MODEL, "--chat", "--id", "j1", "Hi")[:2] == (0, "j1\n")
    assert cli(c, capsys, "submit", "--model", MODEL, "--chat", "--id", "j1", "Hi")[:2] == (0, "j1\n")
    code, _, err = cli(c, capsys, "submit", "--model", MODEL, "--id", "j1", "Other")
    assert code == 5 and "different request body" in err
    (_, fields), = c.redis.xrange(c.keys.jobs(MODEL))
    assert json.loads(fields["body"])["messages"] == [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("argv", [
    ["submit", "--max-tokens", "0", "hi"], ["submit", "   "], ["submit", "--temperature", "-1", "x"],
    ["submit", "--id", "bad id", "x"], ["submit", "--model", "bad model", "x"],
    ["submit", "--max-tokens", "abc", "x"], ["submit", "--stream", "--wait", "x"],
])
def test_invalid_input_exit_2_nothing_enqueued(c, capsys, argv):
    code, out, err = cli(c, capsys, *argv)
    assert code == 2 and out == "" and err
    assert list(c.redis.scan_iter(c.keys.base + "*")) == []


def test_submit_wait_and_stream(c, capsys):
    t = bg(play_when_submitted, c, "w1", DELTAS[:4])
    code, out, err = cli(c, capsys, "submit", "--model", MODEL, "--id", "w1", "--wait",
                         "--timeout", "5", "x")
    t.join()
    assert (code, out, err) == (0, "".join(DELTAS[:4]) + "\n", "w1\n")
    t = bg(play_when_submitted, c, "s1", DELTAS[:4], delay=0.03)
    code, out, err = cli(c, capsys, "submit", "--model", MODEL, "--id", "s1", "--stream", "x")
    t.join()
    assert (code, out, err) == (0, "".join(DELTAS[:4]) + "\n", "s1\n")


def test_result_failures_and_timeouts(c, capsys):
    jid = c.submit("x")
    code, out, err = cli(c, capsys, "result", jid, "--timeout", "0.2")
    assert code == 4 and "not done" in err
    c.redis.hset(c.keys.job(jid), "status", "running")
    write_final(c, jid, 0, "part", status="failed", error="CUDA out of memory")
    code, out, err = cli(c, capsys, "result", jid)
    assert code == 1 and out == "part\n" and "failed: CUDA out of memory" in err
    assert cli(c, capsys, "status", "missing")[0] == 3
    assert cli(c, capsys, "result", "missing")[0] == 3


def test_cancel(c, capsys):
    jid = c.submit("x")
    assert cli(c, capsys, "cancel", jid)[:2] == (0, "cancelled\n")
    code, _, err = cli(c, capsys, "cancel", jid)
    assert code == 1 and "already cancelled" in err
    code, out, err = cli(c, capsys, "result", jid)
    assert code == 1 and "cancelled" in err
    run = c.submit("y")
    c.redis.hset(c.keys.job(run), "status", "running")
    assert cli(c, capsys, "cancel", run)[:2] == (0, "running\n")
    assert c.redis.sismember(c.keys.cancel, run)
    assert cli(c, capsys, "cancel", "missing")[0] == 3


def test_producer_never_imports_torch():
    code = ("import producer, sys; import producer.client, producer.aio, producer.cli; "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "assert not any(m.split('.')[0] in ('engine', 'worker') for m in sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
