"""The job commands (pagedq/client_cli.py, through pagedq.cli.main) against a real redis-server, and the no-torch import rule."""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import pytest

import pagedq.client_cli as client_cli
from pagedq.cli import build_parser, main, version
from pagedq.producer import Client
from pagedq.wire.keys import out_entry_id
from pagedq.wire.schema import final_fields
from tests.queue_helpers import inbox
from tests.test_producer import DELTAS, bg, play, write_final
from tests.worker_proc import ROOT

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
    assert code == 0 and len(inbox(c.redis, c.keys, MODEL)) == 1
    (fields,) = inbox(c.redis, c.keys, MODEL)
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
    (fields,) = inbox(c.redis, c.keys, MODEL)
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
    assert code == 6 and out == "part\n" and "failed: CUDA out of memory" in err
    assert cli(c, capsys, "status", "missing")[0] == 3
    assert cli(c, capsys, "result", "missing")[0] == 3


def test_cancel(c, capsys):
    jid = c.submit("x")
    assert cli(c, capsys, "cancel", jid)[:2] == (0, "cancelled\n")
    code, _, err = cli(c, capsys, "cancel", jid)
    assert code == 1 and "already cancelled" in err
    code, out, err = cli(c, capsys, "result", jid)
    assert code == 7 and "cancelled" in err
    run = c.submit("y")
    c.redis.hset(c.keys.job(run), "status", "running")
    assert cli(c, capsys, "cancel", run)[:2] == (0, "running\n")
    assert c.redis.sismember(c.keys.cancel, run)
    assert cli(c, capsys, "cancel", "missing")[0] == 3


def test_producer_never_imports_torch():
    code = ("import producer, sys; import pagedq.producer.client, pagedq.producer.aio, pagedq.client_cli; "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "assert not any(m.split('.')[0] in ('engine', 'worker') for m in sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ---- exit codes by how the job ended ---------------------------------------------------

def finish(c: Client, job_id: str, status: str, reason: str, text: str = "", error: str = "",
           index: int = 0) -> None:
    """A worker's finish with a chosen finish_reason: final event + terminal hash."""
    with c.redis.pipeline(transaction=True) as p:
        p.xadd(c.keys.out(job_id), final_fields(index, status, reason, text, error, 3, index),
               id=out_entry_id(index))
        p.hset(c.keys.job(job_id), mapping={"status": status, "text": text, "error": error,
                                              "finish_reason": reason})
        p.execute()


@pytest.mark.parametrize("status,reason,code", [
    ("finished", "stop", 0), ("finished", "length", 0), ("failed", "error", 6),
    ("cancelled", "cancelled", 7), ("expired", "deadline", 8),
    ("finished", "deadline", 8),  # timeout_s ran out mid-generation: not a success
])
def test_result_exit_code_by_outcome(c, capsys, status, reason, code):
    jid = c.submit("x")
    c.redis.hset(c.keys.job(jid), "status", "running")
    finish(c, jid, status, reason, "part", "boom" if status == "failed" else "")
    got, out, err = cli(c, capsys, "result", jid)
    assert (got, out) == (code, "part\n")
    if code == 0:
        assert err == ""
    else:
        assert len(err.splitlines()) == 1 and err.startswith(f"pagedq: job {jid} ")
    if (status, reason) == ("finished", "deadline"):
        assert "deadline" in err and "partial" in err


@pytest.mark.parametrize("mode", ["--stream", "--wait"])
def test_submit_stream_and_wait_exit_8_when_the_deadline_ends_the_job(c, capsys, mode):
    jid = "d" + mode.strip("-")
    text = "".join(DELTAS[:2])

    def worker():
        play_when_submitted(c, jid, DELTAS[:2], finish=False)
        finish(c, jid, "finished", "deadline", text, index=2)

    t = bg(worker)
    code, out, err = cli(c, capsys, "submit", "--model", MODEL, "--id", jid, mode,
                         "--timeout", "5", "x")
    t.join()
    assert (code, out) == (8, text + "\n") and "deadline" in err


def test_result_exit_code_of_a_real_process(c):
    """`python -m pagedq result` with the root options after the subcommand."""
    jid = c.submit("x")
    finish(c, jid, "finished", "deadline", "half")
    r = subprocess.run([sys.executable, "-m", "pagedq", "result", jid, "--redis-url", c.url,
                        "--prefix", c.keys.prefix], capture_output=True, text=True, timeout=60,
                       cwd=ROOT)
    assert (r.returncode, r.stdout) == (8, "half\n") and "deadline" in r.stderr


def test_exit_code_constants_match_the_documented_table():
    codes = {n: v for n, v in vars(client_cli).items()
             if n.startswith("EXIT_") and isinstance(v, int)}
    assert sorted(codes.values()) == list(range(9))  # one name per code, 0..8
    assert (client_cli.EXIT_JOB_FAILED, client_cli.EXIT_JOB_CANCELLED,
            client_cli.EXIT_JOB_EXPIRED) == (6, 7, 8)
    for v in codes.values():
        assert re.search(rf"(?m)^ +{v}  \S", client_cli.__doc__)
        assert re.search(rf"(?m)^ +{v}  \S", client_cli.EXIT_CODES_HELP)
    assert client_cli.exit_code_of("finished", "deadline") == 8
    assert client_cli.exit_code_of("finished", "stop") == 0


# ---- --redis-url/--prefix before or after the subcommand -------------------------------

WRONG = ["--redis-url", "redis://127.0.0.1:1/0", "--prefix", "wrongprefix"]


@pytest.mark.parametrize("where", ["before", "after", "after_text", "both"])
def test_root_options_before_or_after_the_subcommand(c, capsys, where):
    opts = ["--redis-url", c.url, "--prefix", c.keys.prefix]
    argv = {"before": [*opts, "submit", "--model", MODEL, "x"],
            "after": ["submit", *opts, "--model", MODEL, "x"],
            "after_text": ["submit", "--model", MODEL, "x", *opts],
            # given in both places, the value after the subcommand wins
            "both": [*WRONG, "submit", *opts, "--model", MODEL, "x"]}[where]
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    assert len(inbox(c.redis, c.keys, MODEL)) == 1 and out.strip()


@pytest.mark.parametrize("cmd", ["status", "result", "cancel"])
def test_every_client_command_takes_the_root_options_after_it(cmd):
    p = build_parser()
    a = p.parse_args([cmd, "--redis-url", "redis://h:1/0", "--prefix", "px", "ID"])
    assert (a.redis_url, a.prefix, a.id) == ("redis://h:1/0", "px", "ID")
    a = p.parse_args(["--redis-url", "redis://h:1/0", "--prefix", "px", cmd, "ID"])
    assert (a.redis_url, a.prefix) == ("redis://h:1/0", "px")
    a = p.parse_args(["--prefix", "one", cmd, "--prefix", "two", "ID"])
    assert a.prefix == "two" and a.redis_url is None
    assert p.parse_args([cmd, "ID"]).redis_url is None  # None = from Settings()


def test_usage_error_exits_2(capsys):
    assert main(["submit", "--no-such-option", "x"]) == 2
    assert main([]) == 2
    assert "usage:" in capsys.readouterr().err


# ---- --version and help text -----------------------------------------------------------

def test_version(capsys):
    expected = f"pagedq {importlib.metadata.version('pagedq')}\n"
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == expected
    r = subprocess.run([sys.executable, "-m", "pagedq", "--version"], capture_output=True,
                       text=True, timeout=60, cwd=ROOT)
    assert (r.returncode, r.stdout) == (0, expected)


def test_version_falls_back_to_pyproject(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    with open(f"{ROOT}/pyproject.toml") as f:
        expected = re.search(r'(?m)^version = "(.+)"', f.read())[1]
    assert version() == expected


def parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """The parser and every subparser under it."""
    yield parser
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub in a.choices.values():
                yield from parsers(sub)


def options_without_default(parser: argparse.ArgumentParser) -> list[str]:
    bad = []
    for p in parsers(parser):
        for a in p._actions:
            if not a.option_strings or isinstance(a, argparse._HelpAction | argparse._VersionAction):
                continue
            text = p._get_formatter()._expand_help(a) if a.help else ""
            if "default" not in text:
                bad.append(f"{p.prog} {a.option_strings[0]}")
    return bad


def test_every_option_help_states_its_default():
    p = build_parser()
    # 4 job commands, watch, batch and its 7 subcommands, acl, inspect, dlq and its 2
    # subcommands, functions and its 2 (load, show); worker, config, demo, serve, gateway
    # and its key, key add/list/revoke (the one root parser holds every command:
    # pagedq/cli.py)
    assert len(list(parsers(p))) == 19 + 3 + 9
    assert options_without_default(p) == []
