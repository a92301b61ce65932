"""The `pagedq` command (pagedq/cli.py, worker/cli.py): root options before or after the subcommand,
--version, help text, and bad worker settings -> one line on stderr + exit 78 (EX_CONFIG),
checked in real subprocesses (a bad setting is found before the model loads, so these
are cheap; only --model /nonexistent imports torch)."""
from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import subprocess
import sys
import urllib.request
import uuid

import pytest

from pagedq.cli import build_parser, main
from pagedq.producer import Client, Settings
from pagedq.worker import cli as worker_cli
from pagedq.worker import metrics as worker_metrics
from pagedq.worker.cli import EXIT_CONFIG, settings_from
from tests.test_cli_client import options_without_default, parsers
from tests.worker_proc import ROOT

DEAD = "redis://127.0.0.1:1/0"  # nothing listens: a worker that got this far would fail


def pagedq(*argv: str, env: dict[str, str] | None = None,
           timeout: float = 120) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDQ_")}
    return subprocess.run([sys.executable, "-m", "pagedq", *argv], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT,
                          env={**clean, "PYTHONPATH": ROOT, **(env or {})})


def config_error(r: subprocess.CompletedProcess) -> str:
    """The one stderr line of a bad-configuration exit."""
    assert r.returncode == EXIT_CONFIG == 78, (r.returncode, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("pagedq: "), r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
    return lines[0]


# ---- bad settings: exit 78, one line ----------------------------------------------------

@pytest.mark.parametrize("argv,env,words", [
    (["--block-size", "7"], {}, ["--block-size", "8, 16, 32, 64, 128", "got 7"]),
    (["--max-num-seqs", "0"], {}, ["--max-num-seqs", ">= 1"]),
    (["--max-num-batched-tokens", "8", "--max-num-seqs", "16"], {},
     ["--max-num-batched-tokens", "--max-num-seqs"]),
    (["--dtype", "float8"], {}, ["--dtype", "bfloat16"]),
    (["--device", "banana"], {}, ["--device", "'banana'", "cpu", "cuda:N"]),
    (["--device", "cuda:x"], {}, ["--device", "cuda:N"]),
    (["--metrics-port", "-1"], {}, ["--metrics-port", "PAGEDQ_METRICS_PORT", "greater than or equal to 0"]),
    ([], {"PAGEDQ_LEASE_S": "-3"}, ["PAGEDQ_LEASE_S", "greater than 0"]),
    (["--metrics-port", "9100", "--metrics-host", "no-such-host.invalid"], {},
     ["--metrics-host", "no-such-host.invalid", "0.0.0.0"]),
    (["--served-name", "a/b"], {}, ["--served-name", "A-Za-z0-9"]),
])
def test_bad_worker_setting_exits_78_with_one_line(argv, env, words):
    line = config_error(pagedq("worker", "--redis-url", DEAD, *argv, env=env))
    for w in words:
        assert w in line, line


def test_missing_model_exits_78_with_one_line():
    line = config_error(pagedq("worker", "--redis-url", DEAD, "--device", "cpu",
                               "--model", "/nonexistent", timeout=300))
    assert "unknown model '/nonexistent'" in line and ".gguf" in line


def test_demo_checks_its_settings_first():
    config_error(pagedq("demo", "--device", "banana"))


def test_usage_errors_exit_2():
    for argv in (["worker", "--block-size", "seven"], ["worker", "--log-level", "loud"],
                 ["worker", "--no-such-option"], []):
        r = pagedq(*argv)
        assert r.returncode == 2 and "usage:" in r.stderr, (argv, r.stderr)


# ---- --redis-url/--prefix before or after the subcommand --------------------------------

@pytest.mark.parametrize("argv", [
    ["--redis-url", "foo://x", "worker"],
    ["worker", "--redis-url", "foo://x"],
    ["--redis-url", DEAD, "worker", "--redis-url", "foo://x"],  # the one after wins
])
def test_worker_redis_url_in_either_position(argv):
    line = config_error(pagedq(*argv))
    assert "--redis-url" in line and "'foo://x'" in line and "redis://" in line


def test_worker_options_after_the_subcommand_win():
    # a valid URL after the subcommand overrides a bad one before it
    line = config_error(pagedq("--redis-url", "foo://x", "--prefix", "bad prefix", "worker",
                               "--redis-url", DEAD, "--prefix", "ok", "--block-size", "7"))
    assert "--block-size" in line
    line = config_error(pagedq("worker", "--prefix", "bad prefix", "--redis-url", DEAD))
    assert "--prefix" in line and "'bad prefix'" in line


@pytest.mark.parametrize("argv,url,prefix", [
    (["--redis-url", "redis://a:1/0", "--prefix", "pa", "worker"], "redis://a:1/0", "pa"),
    (["worker", "--redis-url", "redis://b:1/0", "--prefix", "pb"], "redis://b:1/0", "pb"),
    (["--redis-url", "redis://a:1/0", "--prefix", "pa", "worker", "--redis-url",
      "redis://b:1/0", "--prefix", "pb"], "redis://b:1/0", "pb"),
    (["--prefix", "pa", "worker", "--redis-url", "redis://b:1/0"], "redis://b:1/0", "pa"),
    (["worker"], None, None),
])
def test_worker_parse_positions(monkeypatch, argv, url, prefix):
    a = build_parser().parse_args(argv)
    assert (a.redis_url, a.prefix) == (url, prefix)
    monkeypatch.delenv("PAGEDQ_REDIS_URL", raising=False)
    monkeypatch.delenv("PAGEDQ_PREFIX", raising=False)
    s = settings_from(a)
    assert (s.redis_url, s.prefix) == (url or "redis://127.0.0.1:6379/0", prefix or "pagedq")


@pytest.mark.parametrize("before", [True, False])
def test_pagedq_submit_options_in_either_position(shared_redis_server, capsys, before):
    prefix = "cw" + uuid.uuid4().hex[:10]
    opts = ["--redis-url", shared_redis_server.url, "--prefix", prefix]
    argv = [*opts, "submit", "--model", "m1", "x"] if before else \
        ["submit", "--model", "m1", "x", *opts]
    assert main(argv) == 0, capsys.readouterr().err
    with Client(shared_redis_server.url, prefix=prefix, model="m1") as c:
        assert c.redis.llen(c.keys.inbox("m1")) == 1


def test_pagedq_result_exit_codes_through_the_pagedq_entry(shared_redis_server, capsys):
    from tests.test_cli_client import finish

    prefix = "cw" + uuid.uuid4().hex[:10]
    with Client(shared_redis_server.url, prefix=prefix, model="m1") as c:
        for status, reason, code in (("failed", "error", 6), ("cancelled", "cancelled", 7),
                                     ("finished", "deadline", 8), ("finished", "stop", 0)):
            jid = c.submit("x")
            finish(c, jid, status, reason, "t")
            assert main(["result", jid, "--redis-url", shared_redis_server.url,
                         "--prefix", prefix]) == code
    capsys.readouterr()


# ---- --version, help -------------------------------------------------------------------

def test_version(capsys):
    expected = f"pagedq {importlib.metadata.version('pagedq')}\n"
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == expected
    r = pagedq("--version")
    assert (r.returncode, r.stdout) == (0, expected)


def test_every_option_help_states_its_default():
    p = build_parser()
    assert {sp.prog for sp in parsers(p)} == {
        "pagedq", *(f"pagedq {c}" for c in ("worker", "demo", "serve", "submit", "status",
                                            "result", "cancel", "batch", "config", "acl",
                                            "watch")),
        *(f"pagedq batch {c}" for c in ("submit", "status", "results", "cancel", "retry", "list",
                                        "worker")),
        *(f"pagedq {c}" for c in ("inspect", "dlq", "dlq list", "dlq requeue",
                                      "functions", "functions load", "functions show")),
        *(f"pagedq gateway{c}" for c in ("", " key", " key add", " key list", " key revoke"))}
    assert options_without_default(p) == []


def test_engine_defaults_in_help_match_engine_config():
    from pagedq.engine.config import EngineConfig

    cfg = EngineConfig()
    w = next(sp for sp in parsers(build_parser()) if sp.prog == "pagedq worker")
    helps = {a.dest: a.help for a in w._actions}
    for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
        assert f"(default: {getattr(cfg, name)})" in helps[name], name
    ints = {a.dest for a in w._actions if a.type is int} - set(Settings.model_fields)
    assert ints and {f.name for f in dataclasses.fields(EngineConfig)} >= ints


def test_help_documents_exit_codes(capsys):
    assert main(["-h"]) == 0
    out = capsys.readouterr().out
    assert "exit codes of the client commands" in out and "exit codes of `pagedq worker`" in out
    for line in ("   8  job expired", "  78  bad configuration", "  70  a wedged engine step",
                 "  71  an unexpected error", " 128+N  killed by a second signal"):
        assert line in out
    assert main(["worker", "-h"]) == 0
    assert "  78  bad configuration" in capsys.readouterr().out
    assert (worker_cli.EXIT_CLEAN, worker_cli.EXIT_WEDGED, worker_cli.EXIT_THREAD_ERROR,
            worker_cli.EXIT_CONFIG) == (0, 70, 71, 78)


# ---- metrics endpoint address ----------------------------------------------------------

def test_metrics_host_setting_and_binding(monkeypatch):
    a = build_parser().parse_args(["worker", "--metrics-port", "9", "--metrics-host", "0.0.0.0"])
    s = settings_from(a)
    assert (s.metrics_port, s.metrics_host) == (9, "0.0.0.0")
    monkeypatch.delenv("PAGEDQ_METRICS_HOST", raising=False)
    assert settings_from(build_parser().parse_args(["worker"])).metrics_host == "127.0.0.1"

    m = worker_metrics.Metrics()
    port = m.serve(0)  # loopback by default, a real HTTP server
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200 and b"pagedq:" in resp.read()

    assert m.server.server_address[0] == "127.0.0.1"  # the address really bound
    m.server.shutdown()
    m.serve(0, "0.0.0.0")
    assert m.server.server_address[0] == "0.0.0.0"
    m.server.shutdown()
