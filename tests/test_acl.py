"""Least-privilege Redis users (`pagedq acl`, admin/acl.py) on a real Redis 7 server
started with the generated ACL file, two tenants (key prefixes) and one real worker
process serving both (`--prefixes`, its own `worker` user). Each role does what it must and
is refused (NOPERM) what it must not; a tenant's flood does not starve another tenant.
Nothing is mocked; every wait is a condition with a deadline."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis

from pagedq.admin import acl
from pagedq.batch import Batches, BatchSettings
from pagedq.cli import main as cli_main
from pagedq.gateway import apikeys
from pagedq.producer import AsyncClient, Client
from pagedq.wire import lua
from pagedq.wire.errors import JobNotFound
from pagedq.wire.invariants import queue_counters
from pagedq.wire.keys import GROUP, Keys
from pagedq.wire.scripts import Cancel
from pagedq.wire.settings import Settings
from pagedq.worker.redis_server import RedisServer
from pagedq.worker.tenants import fair_take, rotated
from tests.queue_helpers import move
from tests.test_batch_e2e import RqWorker, until
from tests.test_gateway import CHAT, Gateway
from tests.tiny_service import MODEL
from tests.worker_proc import ROOT, WorkerProc

T1, T2 = "acl1", "acl2"  # the tenants' prefixes
NON_ADMIN = [f"producer-{T1}", f"reader-{T1}", f"batch-{T1}", "worker", "gateway"]


class Env:
    """The module's server, secrets and worker; clients and raw connections per user."""

    def __init__(self, srv: RedisServer, secrets: Path, aclfile: Path) -> None:
        self.srv, self.secrets, self.aclfile = srv, secrets, aclfile
        self.closers: list = []

    def password(self, user: str) -> str:
        return (self.secrets / user).read_text()

    def settings(self, user: str, prefix: str = T1, **kw) -> Settings:
        return Settings(redis_url=self.srv.url, prefix=prefix, model=MODEL,
                        redis_username=user, redis_password=self.password(user), **kw)

    def client(self, user: str, prefix: str = T1) -> Client:
        c = Client(settings=self.settings(user, prefix))
        self.closers.append(c.close)
        return c

    def raw(self, user: str) -> redis.Redis:
        r = redis.Redis(host="127.0.0.1", port=self.srv.port, username=user,
                        password=self.password(user), decode_responses=True)
        self.closers.append(r.close)
        return r

    def user_env(self, user: str) -> dict[str, str]:
        """How a process is given its user: the name and a secrets file, no password on
        its command line (wire/connection.py)."""
        return {"PAGEDQ_REDIS_USERNAME": user,
                "PAGEDQ_REDIS_PASSWORD_FILE": str(self.secrets / user)}


class AclWorker(WorkerProc):
    """A worker process that logs in as ``user``; its readiness is checked as admin."""

    def __init__(self, acl_env: Env, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.admin = acl_env.raw("admin")

    def wait_ready(self, timeout: float = 180.0) -> None:
        key = Keys(self.prefix).worker(self.worker_id)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited ({self.proc.returncode}):\n{self.log()}")
            if self.admin.exists(key):
                return
            time.sleep(0.1)
        raise TimeoutError(f"worker not ready in {timeout}s:\n{self.log()}")


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_dir):
    d = tmp_path_factory.mktemp("acl")
    secrets, aclfile = d / "secrets", d / "users.acl"
    # the gateway user serves tenant one only, its API keys under tenant one's prefix
    assert cli_main(["acl", "--tenant", f"{T1},{T2}", "--secrets-dir", str(secrets),
                     "--gateway-prefixes", T1, "--gateway-admin-prefix", T1,
                     "-o", str(aclfile)]) == 0
    # Redis >= 7.0 (selectors, %R~/%W~): a clear error, not a skip, when there is none.
    # DEBUG allowed from localhost, so that only the ACL can refuse it below.
    srv = RedisServer(min_version=(7, 0), extra=["--aclfile", str(aclfile),
                                                 "--enable-debug-command", "local"]).start()
    e = Env(srv, secrets, aclfile)
    w = AclWorker(e, srv.url, T1, model=tiny_dir,
                  extra=["--served-name", MODEL, "--max-num-seqs", "2", "--prefixes",
                         f"{T1},{T2}"],
                  env={**e.user_env("worker"), "PAGEDQ_FAILPOINTS": "step_sleep_s=0.02",
                       "PAGEDQ_LEASE_S": "2", "PAGEDQ_HEARTBEAT_TTL_S": "3"})
    try:
        w.start()
        e.worker = w
        yield e
    finally:
        w.stop(10)
        for close in e.closers:
            close()
        srv.cleanup()


def noperm(fn, *args, **kw) -> None:
    """Run a call that the ACL must refuse (a NOPERM reply: redis-py's NoPermissionError)."""
    with pytest.raises(redis.exceptions.NoPermissionError, match="no permissions"):
        fn(*args, **kw)


# ---------------------------------------------------------------- the file and the CLI

def test_fair_shares_of_a_lane_among_tenants():
    stock = {"a": 30, "b": 2, "c": 0}
    calls = []

    def read(ask):
        calls.append(dict(ask))
        out = {}
        for t, n in ask.items():
            out[t] = ["x"] * min(n, stock[t])
            stock[t] -= len(out[t])
        return out

    got = fair_take(6, ["a", "b", "c"], read)
    assert {t: len(v) for t, v in got.items()} == {"a": 4, "b": 2, "c": 0}
    assert calls[0] == {"a": 2, "b": 2, "c": 2}  # equal shares first
    calls.clear()
    assert len(fair_take(1, ["b", "a"], read)["a"]) == 1 and calls == [{"b": 1}, {"a": 1}]
    calls.clear()
    assert len(fair_take(5, ["a"], read)["a"]) == 5 and calls == [{"a": 5}]  # one read
    assert rotated(["a", "b", "c"], 4) == ["b", "c", "a"]


def test_the_file_is_built_from_the_key_scheme_and_keeps_no_password(tmp_path, capsys,
                                                                     monkeypatch):
    pw = "p" * 20
    monkeypatch.setenv("PAGEDQ_ACL_PASSWORD_PRODUCER_T_1", pw)
    out = tmp_path / "users.acl"
    assert cli_main(["acl", "--tenant", "t-1", "--prefix", "gw", "-o", str(out)]) == 0
    text, err = out.read_text(), capsys.readouterr().err
    lines = {ln.split()[1]: ln for ln in text.splitlines()}
    assert set(lines) == {"default", "producer-t-1", "reader-t-1", "batch-t-1", "worker",
                          "gateway", "scaler", "admin"}
    assert lines["default"].startswith("user default off")
    k = Keys("t-1")
    producer = lines["producer-t-1"]
    assert f"#{acl.password_hash(pw)}" in producer and pw not in text
    # patterns from wire/keys.py; the jobs streams only in the scripts' selector
    root, selector = producer.split(" (")
    assert f"~{k.job('*')}" in root and f"&{k.chan('*')}" in root and k.jobs("*", "*") not in root
    assert selector.startswith(f"~{k.inbox('*', '*')} ") and selector.endswith(
        "+fcall +fcall_ro +rpush)") and k.inbox("*", "*") not in root
    assert k.jobs("*", "*") not in producer  # the jobs streams are the workers' alone
    for cmd in ("+eval", "+evalsha", "+script", "+function"):
        assert cmd not in producer.split(), cmd
    assert f"%R~{k.job('*')}" in lines["reader-t-1"] and "+hset" not in lines["reader-t-1"]
    assert "~rq:*" in lines["batch-t-1"] and f"~{k.base}:*" in lines["worker"]
    # the gateway: the batch role's keys and the uploads' of the tenants; its API keys
    # (read only) and rate windows under its own prefix (default: --prefix); ADMIT's
    # commands parsed from its text (HLEN)
    gw_root, gw_tenant_sel, gw_keys_sel = lines["gateway"].split(" (")
    home = Keys("gw")
    assert f"~{k.file('*')}" in gw_root and f"~{k.batch('*')}" in gw_root
    assert f"%R~{home.apikeys}" in gw_root and f"~{home.ratelimit('*', '*')}" in gw_root
    assert "+hlen" in gw_root and "~rq:*" in gw_root and k.apikeys not in lines["gateway"]
    assert f"~{k.inbox('*', '*')}" in gw_tenant_sel and k.inbox("*", "*") not in gw_root
    assert gw_keys_sel == f"~{home.apikeys} +fcall +fcall_ro)"
    assert "+function|load" in lines["worker"] and "+eval" not in lines["worker"].split()
    assert all("-@dangerous" in ln for name, ln in lines.items()
               if name not in ("admin", "default"))
    # the other users' passwords were generated and shown once, on stderr only
    shown = dict(ln.split() for ln in err.splitlines()[1:])
    assert set(shown) == set(lines) - {"default", "producer-t-1"}
    assert all(acl.password_hash(p) in lines[u] for u, p in shown.items())


def test_every_script_command_is_seen_by_the_parser():
    """A command a script runs that the parser missed would be missing from its role."""
    for name in lua.NAMES:
        text = lua.source(name)
        calls = len(re.findall(r"redis\.p?call\s*\(|pcall\s*\(\s*redis\.call\s*,", text))
        found = len(re.findall(r"redis\.p?call\s*[(,]\s*'[A-Za-z]+'", text))
        assert calls == found, name
    assert "xgroup|create" in acl.commands_of_scripts(("move",))
    assert "xrevrange" in acl.commands_of_scripts(("cancel",))  # pcall(redis.call, ...)


def test_each_role_gets_the_commands_of_the_scripts_it_declares_it_runs():
    """wire/lua's SCRIPTS say who runs what: a role's command rules hold every command of
    its scripts, and no role but the worker's gets a worker script's XACK."""
    assert set().union(*(s.roles for s in lua.SCRIPTS.values())) <= set(acl.ROLES)
    for role in ("producer", "batch", "worker", "gateway"):
        rules = set(acl.command_rules(role))
        mine = [n for n, s in lua.SCRIPTS.items() if role in s.roles]
        assert mine, role
        for name in mine:
            assert {f"+{c}" for c in acl.commands_of_scripts((name,))} <= rules, (role, name)
    assert "+hdel" in acl.command_rules("batch")  # batch_release.lua
    assert "+xack" in acl.command_rules("worker") and "+xack" not in acl.command_rules("producer")


def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, monkeypatch):
    out = tmp_path / "users.acl"
    for argv, what in [(["--tenant", "bad{x}"], "invalid prefix"),
                       (["--roles", "producer,boss"], "unknown role 'boss'"),
                       (["--no-generate"], "no password for user producer-pagedq"),
                       (["--tenant", "a,a"], "named twice")]:
        assert cli_main(["acl", *argv, "-o", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("pagedq: ") and what in err and err.count("\n") == 1, err
    monkeypatch.setenv("PAGEDQ_ACL_PASSWORD_ADMIN", "short")
    assert cli_main(["acl", "--roles", "admin", "-o", str(out)]) == 2
    assert "shorter than 16" in capsys.readouterr().err and not out.exists()
    monkeypatch.setenv("PAGEDQ_ACL_PASSWORD_ADMIN", "a-long-enough-password")
    assert cli_main(["acl", "--roles", "admin", "-o", str(tmp_path / "no" / "x.acl")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("pagedq: ") and "no/x.acl" in err and err.count("\n") == 1
    # --secrets-dir: made once (0600), then read back: the same hashes
    sec = tmp_path / "s"
    monkeypatch.delenv("PAGEDQ_ACL_PASSWORD_ADMIN")
    assert cli_main(["acl", "--roles", "admin,worker", "--secrets-dir", str(sec),
                     "-o", str(out)]) == 0
    first = out.read_text()
    assert (sec / "admin").stat().st_mode & 0o777 == 0o600 and not capsys.readouterr().err
    assert cli_main(["acl", "--roles", "admin,worker", "--secrets-dir", str(sec),
                     "-o", str(out)]) == 0
    assert out.read_text() == first


# ---------------------------------------------------------------- roles on a real server

def test_producer_submits_streams_and_cancels_its_own_jobs(env):
    c = env.client(f"producer-{T1}")
    job = c.submit("hello", max_tokens=5, ignore_eos=True)
    evs = list(c.stream(job, timeout=60))
    rec = c.result(job, timeout=60)
    assert rec.status == "finished" and evs[-1].type == "final" and evs[-1].text == rec.text
    assert c.status(job).usage.completion_tokens == 5
    assert c.served_models() == {MODEL: 1}
    long = c.submit("long", max_tokens=400, ignore_eos=True)
    until(lambda: c.status(long).status == "running", "the long job running", 60)
    assert c.cancel(long)
    assert c.result(long, timeout=60).status == "cancelled"
    # its own tenant's queue: it may add to it, never read or delete it
    r, k = env.raw(f"producer-{T1}"), Keys(T1)
    noperm(r.xrange, k.jobs(MODEL, "interactive"))
    noperm(r.delete, k.jobs(MODEL, "interactive"))
    noperm(r.scan, 0)
    noperm(r.execute_command, "PSUBSCRIBE", k.chan("*"))
    noperm(r.smembers, k.cancel)


def test_reader_reads_with_read_only_rights(env, capsys, monkeypatch):
    p = env.client(f"producer-{T1}")
    job = p.submit("read me", max_tokens=4, ignore_eos=True)
    rd = env.client(f"reader-{T1}")
    rec = rd.result(job, timeout=60)  # no MULTI: a read-only user may wait for it
    assert rec.status == "finished" and rd.status(job).text == rec.text
    evs = list(rd.stream(job, timeout=30))
    assert [e.index for e in evs] == list(range(len(evs))) and evs[-1].text == rec.text

    async def read_async():
        async with AsyncClient(settings=env.settings(f"reader-{T1}")) as ac:
            return (await ac.result(job, timeout=30)).text
    assert asyncio.run(read_async()) == rec.text
    # any write is refused
    r, k = env.raw(f"reader-{T1}"), Keys(T1)
    noperm(rd.submit, "x")
    noperm(rd.cancel, job)
    noperm(r.hset, k.job(job), "status", "failed")
    noperm(r.xadd, k.out(job), {"t": "final"})
    noperm(r.delete, k.job(job))
    noperm(r.publish, k.chan(job), "x")
    assert rd.status(job).status == "finished"
    # the CLI as the reader; for a queued job, `status` would also ask whether a worker
    # serves its model: a script, which a reader may not run (the hint is left out)
    queued = p.submit("wait", model="nobody-serves-this")
    for name, value in env.user_env(f"reader-{T1}").items():
        monkeypatch.setenv(name, value)
    for job_id, status in ((job, "finished"), (queued, "queued")):
        assert cli_main(["--redis-url", env.srv.url, "--prefix", T1, "status", job_id]) == 0
        assert json.loads(capsys.readouterr().out)["status"] == status
    assert p.cancel(queued)


def test_another_tenant_cannot_read_cancel_or_forge_a_job(env):
    a = env.client(f"producer-{T1}")
    job = a.submit("tenant one's secret prompt", max_tokens=300, ignore_eos=True)
    until(lambda: a.status(job).status == "running", "the job running", 60)
    r, k = env.raw(f"producer-{T2}"), Keys(T1)
    cancel_keys, cancel_args = Cancel(k, job, Settings()).keys_args()
    for what in (lambda: r.xrange(k.jobs(MODEL, "interactive")),
                 lambda: r.hget(k.job(job), "status"),
                 lambda: r.hset(k.job(job), "status", "finished"),
                 lambda: r.xadd(k.out(job), {"t": "final", "text": "forged"}),
                 lambda: r.fcall("pagedq_cancel", 3, *cancel_keys, *cancel_args),
                 lambda: r.execute_command("SUBSCRIBE", k.chan(job))):
        noperm(what)
    # through the client too: its keys are tenant one's, its user tenant two's
    b_on_1 = Client(settings=env.settings(f"producer-{T2}", prefix=T1))
    try:
        noperm(b_on_1.status, job)
        noperm(b_on_1.cancel, job)
    finally:
        b_on_1.close()
    with pytest.raises(JobNotFound):  # in its own tenant the id names nothing
        env.client(f"producer-{T2}", T2).status(job)
    assert a.cancel(job) and a.result(job, timeout=60).status == "cancelled"


BUSY_LOOP = "#!lua name=spin\nredis.register_function('spin', function() while true do end end)"


def test_each_role_runs_pagedqs_functions_alone_and_cannot_cut_the_queue(env):
    """docs/security.md "What each role may do": the producer, batch and gateway users run
    pagedq's functions (FCALL) and no Lua of their own (no EVAL, SCRIPT LOAD or FUNCTION
    LOAD: a busy loop would stall every client), and cannot remove queued jobs: no XADD
    MAXLEN/MINID or XTRIM on a jobs stream (they have no right on it at all), no LTRIM,
    LPOP, DEL or LRANGE on an inbox. A job queued meanwhile stays queued and counted. The
    reader runs no script; the worker loads the library (and nothing else of FUNCTION)."""
    adm, k = env.raw("admin"), Keys(T1)
    p = env.client(f"producer-{T1}")
    model = "nobody-acl"  # no worker serves it: its job waits in the lane's inbox
    job = p.submit("keep me queued", model=model, max_tokens=2)
    box, stream = k.inbox(model), k.jobs(MODEL)
    assert adm.exists(stream) and adm.llen(box) == 1
    for user in (f"producer-{T1}", f"batch-{T1}", "gateway", f"reader-{T1}", "worker"):
        r = env.raw(user)
        noperm(r.eval, "return 1", 0)
        noperm(r.evalsha, "0" * 40, 0)
        noperm(r.script_load, "return 1")
        noperm(r.execute_command, "FUNCTION", "DELETE", "pagedq")
        noperm(r.execute_command, "FUNCTION", "FLUSH")
        if user == "worker":
            continue
        noperm(r.execute_command, "FUNCTION", "LOAD", BUSY_LOOP)
        noperm(r.execute_command, "XADD", stream, "MAXLEN", "0", "*", "x", "y")
        noperm(r.execute_command, "XADD", stream, "MINID", "99999999999999", "*", "x", "y")
        noperm(r.xtrim, stream, maxlen=0)
        noperm(r.xrange, stream)
        for cut, *args in ((r.ltrim, box, 1, 0), (r.lpop, box), (r.delete, box),
                           (r.lrange, box, 0, -1), (r.expire, box, 1)):
            noperm(cut, *args)
        if user == f"reader-{T1}":
            noperm(r.fcall, "pagedq_served", 1, k.models, k.base)
        else:  # a worker's function runs with the caller's rights: MOVE's LPOP is refused
            with pytest.raises(redis.exceptions.ResponseError, match="can't|permissions"):
                r.fcall("pagedq_move", 2, box, k.jobs(model), k.base, 10, GROUP)
    assert adm.llen(box) == 1 and not adm.exists(k.jobs(model))
    snap = queue_counters(adm, k, model)
    assert snap.ok and snap.queued_jobs == 1, snap
    assert p.status(job).status == "queued" and p.cancel(job)
    # the worker loaded the library at its start: this version, made from wire/lua/
    assert adm.fcall_ro("pagedq_version", 0) == lua.library_version()
    assert "spin" not in str(adm.execute_command("FUNCTION", "LIST"))


def test_non_admin_users_get_no_server_wide_command(env):
    for user in NON_ADMIN:
        r = env.raw(user)
        noperm(r.flushall)
        noperm(r.config_get, "maxmemory")
        noperm(r.keys, "*")
        noperm(r.execute_command, "DEBUG", "SLEEP", "0")
        noperm(r.acl_setuser, user, enabled=True, commands=["+@all"])
    # the admin reads what `pagedq inspect` reads
    adm, k = env.raw("admin"), Keys(T1)
    assert adm.config_get("maxmemory") and k.worker(env.worker.worker_id) in set(
        adm.scan_iter(match=f"{k.base}:*"))
    assert any(g["name"] == GROUP for g in adm.xinfo_groups(k.jobs(MODEL, "interactive")))
    assert adm.hget(k.worker(env.worker.worker_id), "model") == MODEL
    assert queue_counters(adm, k, MODEL).ok


def test_one_worker_serves_two_tenants(env):
    jobs = {p: env.client(f"producer-{p}", p).submit(f"from {p}", max_tokens=6,
                                                     ignore_eos=True) for p in (T1, T2)}
    adm = env.raw("admin")
    for p, job in jobs.items():
        rec = env.client(f"reader-{p}", p).result(job, timeout=60)
        assert rec.status == "finished" and rec.usage.completion_tokens == 6
        k = Keys(p)
        assert adm.zscore(k.serving(MODEL), env.worker.worker_id)  # announced in both
        assert queue_counters(adm, k, MODEL).ok
        assert adm.xpending(k.jobs(MODEL, "interactive"), GROUP)["pending"] == 0
    assert "NOPERM" not in env.worker.log(None) and "no permissions" not in env.worker.log(None)


def test_takeover_and_dead_letters_use_the_jobs_tenant(env):
    """An entry of tenant two left pending by a dead consumer is taken over, and a bad one
    dead-lettered, each with tenant two's keys."""
    w, adm, k2 = env.worker, env.raw("admin"), Keys(T2)
    b = env.client(f"producer-{T2}", T2)
    stream = k2.jobs(MODEL, "interactive")
    w.signal(signal.SIGSTOP)  # so that the dead consumer, not the worker, reads the entry
    try:
        # its last blocking read (500 ms) must have ended, or it would still get it
        until(lambda: not any("b" in c["flags"] for c in adm.client_list()),
              "no client blocked on a stream", 10)
        job = b.submit("orphan", max_tokens=3, ignore_eos=True)
        assert move(adm, k2, MODEL) == 1  # (what a worker's read does first)
        assert adm.xreadgroup(GROUP, "ghost", {stream: ">"}, count=1)
        adm.xadd(stream, {"job": "bad-entry", "body": "{not json"})
    finally:
        w.signal(signal.SIGCONT)
    rec = b.result(job, timeout=60)  # after PAGEDQ_LEASE_S=2
    assert rec.status == "finished" and rec.usage.completion_tokens == 3
    assert '"entry_reclaimed"' in w.log(None) and f'"prefix": "{T2}"' in w.log(None)
    bad = b.result("bad-entry", timeout=60)
    assert bad.status == "failed" and "not JSON" in bad.error
    (_, entry), = adm.xrange(k2.dlq(MODEL, "interactive"))
    assert entry["job"] == "bad-entry" and not adm.exists(Keys(T1).dlq(MODEL, "interactive"))
    assert adm.xpending(stream, GROUP)["pending"] == 0


def test_a_tenants_flood_does_not_starve_another_tenant(env):
    """Tenant one floods 30 jobs, tenant two sends 2 after them: with 2 seats and fair
    shares, tenant two's jobs start long before tenant one's flood has run."""
    a, b = env.client(f"producer-{T1}"), env.client(f"producer-{T2}", T2)
    flood = a.submit_many([{"prompt": f"flood {i}", "max_tokens": 5, "ignore_eos": True}
                           for i in range(30)])
    late = [b.submit(f"late {i}", max_tokens=5, ignore_eos=True) for i in range(2)]
    started = {j: a.result(j, timeout=180).started_at for j in flood}
    b_started = max(b.result(j, timeout=180).started_at for j in late)
    after = sum(t > b_started for t in started.values())
    assert after >= 20, f"tenant two started after {30 - after} of tenant one's 30 jobs"


def test_batch_user_runs_a_batch_through_a_real_rq_worker(env, tmp_path):
    user, batch_dir = f"batch-{T1}", tmp_path / "batches"
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps({"custom_id": f"r{i}", "method": "POST",
                                         "url": "/v1/completions",
                                         "body": {"prompt": f"p{i}", "max_tokens": 3}})
                             for i in range(4)) + "\n")
    # tests/test_batch_e2e.py's RqWorker, started as `pagedq batch worker` under the batch
    # user (its name and secrets file in the environment); registration checked as admin
    rq = RqWorker(env.srv.url, batch_dir,
                  {**env.user_env(user), "PAGEDQ_BATCH_QUEUE": "acl-batch"})
    rq.name, rq._log = f"rq-{os.urandom(4).hex()}", open(rq.log_path, "ab")
    rq.proc = subprocess.Popen(
        [sys.executable, "-m", "pagedq", "--redis-url", env.srv.url, "batch", "worker",
         "--prefix", T1, "--name", rq.name], stdout=rq._log, stderr=subprocess.STDOUT,
        cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT, **rq.env})
    adm = env.raw("admin")
    try:
        until(lambda: rq.proc.poll() is not None
              or adm.sismember("rq:workers", f"rq:worker:{rq.name}"),
              "the rq worker registered", 60, 0.05)
        assert rq.proc.poll() is None, rq.log()
        bs = BatchSettings(batch_dir=str(batch_dir), batch_queue="acl-batch")
        with Batches(env.srv.url, prefix=T1, model=MODEL, settings=env.settings(user),
                     batch_settings=bs) as bt:
            b = bt.create(src)
            end = bt.wait(b.id, timeout=120)
            assert end.status == "completed", (end, rq.log())
            assert sorted(r["custom_id"] for r in bt.results(b.id)) == [f"r{i}"
                                                                       for i in range(4)]
        assert "NOPERM" not in rq.log() and "no permissions" not in rq.log(), rq.log()
    finally:
        rq.stop()


def test_gateway_user_serves_its_tenant_and_nothing_more(env, tmp_path):
    """`pagedq gateway` (a real process, as tests/test_gateway.py starts it) logged in as
    the gateway user: a key of tenant one gets a chat completion through the worker, a
    streamed one, cancelled when the client leaves, the models and a file upload; the
    rate window is charged and settled. Then what the user must not do."""
    adm, k = env.raw("admin"), Keys(T1)
    key, _ = apikeys.add(apikeys.KeyRecord(T1, rpm=100, tpm=100_000, name="acl"), r=adm,
                         admin_prefix=T1)  # keys are the admin's to make
    gw = Gateway(env.srv.url, tmp_path / "batches", prefix=T1, env=env.user_env("gateway"))
    auth = {"Authorization": f"Bearer {key}"}
    try:
        gw.wait_ready()
        r = httpx.post(gw.base + "/v1/chat/completions", headers=auth, timeout=120,
                       json={"model": MODEL, "messages": CHAT, "max_tokens": 5,
                             "ignore_eos": True, "logprobs": True, "top_logprobs": 1})
        assert r.status_code == 200, (r.text, gw.log())
        body, reader = r.json(), env.client(f"reader-{T1}")
        rec = reader.status(body["id"].split("-", 1)[1])
        assert rec.status == "finished" and rec.usage.completion_tokens == 5
        assert body["choices"][0]["message"]["content"] == rec.text
        assert len(body["choices"][0]["logprobs"]["content"]) == 5  # XRANGE of its events
        # ADMIT charged the key's window, SETTLE corrected it to the job's usage
        (window,) = adm.keys(k.ratelimit(apikeys.hash_key(key), "*"))
        used = rec.usage.prompt_tokens + rec.usage.completion_tokens
        assert adm.hgetall(window) == {"r": "1", "t": str(used)}
        # a stream the client leaves: the gateway cancels its job (CANCEL)
        with httpx.Client(timeout=60) as http, http.stream(
                "POST", gw.base + "/v1/chat/completions", headers=auth,
                json={"model": MODEL, "messages": CHAT, "max_tokens": 300,
                      "ignore_eos": True, "stream": True}) as resp:
            assert resp.status_code == 200, resp.read()
            first = next(ln for ln in resp.iter_lines() if ln.startswith("id: "))
        job = first[4:].rpartition("/")[0]
        rec = until(lambda: (x := reader.status(job)).done and x, f"job {job} ended", 60)
        assert rec.status == "cancelled" and rec.usage.completion_tokens < 300
        models = httpx.get(gw.base + "/v1/models", headers=auth, timeout=30)
        assert [m["id"] for m in models.json()["data"]] == [MODEL], models.text
        line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                           "body": {"model": MODEL, "prompt": "x", "max_tokens": 2}})
        up = httpx.post(gw.base + "/v1/files", headers=auth, timeout=30, data={"purpose": "batch"},
                        files={"file": ("in.jsonl", line.encode() + b"\n")})
        assert up.status_code == 200, up.text
        listed = httpx.get(gw.base + "/v1/files", headers=auth, timeout=30).json()["data"]
        assert [f["id"] for f in listed] == [up.json()["id"]]
        log = gw.log(None)
        for bad in ("permission", "NOPERM", "after_request_failed", "unexpected_error"):
            assert bad not in log, log
        # a key of a tenant the user does not serve: one clear error, not "unavailable"
        key2, _ = apikeys.add(apikeys.KeyRecord(T2), r=adm, admin_prefix=T1)
        r = httpx.post(gw.base + "/v1/completions", timeout=30,
                       headers={"Authorization": f"Bearer {key2}"},
                       json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert r.status_code == 500 and r.json()["error"]["code"] == "permission_denied", r.text
        until(lambda: "redis_permission_denied" in gw.log(None), "the error logged", 10)
    finally:
        assert gw.stop() == 0, gw.log()
    # refused: the queue's prompts, the workers' and the DLQ's keys, minting API keys
    # (even from a script naming the hash), a tenant it does not serve, the server
    r, k2 = env.raw("gateway"), Keys(T2)
    assert r.hlen(k.apikeys) == 2
    noperm(r.xrange, k.jobs(MODEL, "interactive"))
    noperm(r.delete, k.jobs(MODEL, "interactive"))
    noperm(r.hgetall, k.worker(env.worker.worker_id))
    noperm(r.xlen, k.dlq(MODEL, "interactive"))
    noperm(r.hset, k.apikeys, "0" * 64, json.dumps({"tenant": T1}))
    with pytest.raises(redis.exceptions.ResponseError, match="can't"):  # its own function
        r.fcall("pagedq_settle", 1, k.apikeys, 5)  # (HINCRBY, refused on the read-only hash)
    assert r.hlen(k.apikeys) == 2 and "t" not in adm.hgetall(k.apikeys)
    noperm(r.hgetall, k2.job("any"))
    noperm(r.xread, {k2.out("any"): "0-0"})
    noperm(r.execute_command, "SUBSCRIBE", k2.chan("any"))
    noperm(r.hset, k2.file("file-x"), "path", "/etc/passwd")


def test_a_partitioned_tenants_users_cover_its_partitions_only(tmp_path):
    """PAGEDQ_PARTITIONS=3 (`pagedq acl --partitions 3`): a tenant's producer submits into,
    reads and cancels in every partition ``{P:p<k>}``; the worker user reads every
    partition's queue; another tenant, even one whose prefix looks like a partition
    (``pa.p1`` beside ``pa``'s ``{pa:p1}``), gets none of them."""
    secrets, aclfile = tmp_path / "secrets", tmp_path / "users.acl"
    assert cli_main(["acl", "--tenant", "pa,pa.p1", "--partitions", "3", "--secrets-dir",
                     str(secrets), "--roles", "producer,worker,admin", "-o", str(aclfile)]) == 0
    srv = RedisServer(min_version=(7, 0), extra=["--aclfile", str(aclfile)]).start()
    e = Env(srv, secrets, aclfile)
    try:
        # no worker here to load pagedq's functions: loaded at deploy, as admin
        with pytest.MonkeyPatch.context() as mp:
            for name, value in e.user_env("admin").items():
                mp.setenv(name, value)
            assert cli_main(["--redis-url", srv.url, "functions", "load"]) == 0
        s = e.settings("producer-pa", prefix="pa", partitions=3)
        with Client(settings=s) as c:
            ids = [c.submit("x", max_tokens=2) for _ in range(3)]
            assert {c.keys_of(i).partition for i in ids} == {0, 1, 2}
            assert all(c.status(i).status == "queued" for i in ids)
            # the worker user moves and reads partition 1's queue
            w, jobs1 = e.raw("worker"), Keys("pa", 1).jobs(MODEL, "interactive")
            assert move(w, Keys("pa", 1), MODEL) == 1 and w.xlen(jobs1) == 1
            assert w.xreadgroup(GROUP, "w", {jobs1: ">"}, count=1)
            assert all(c.cancel(i) for i in ids)
            assert all(c.result(i, timeout=10).status == "cancelled" for i in ids)
        other, p1 = e.raw("producer-pa.p1"), Keys("pa", 1)
        for key in (p1.job(ids[1]), p1.out(ids[1])):
            noperm(other.exists, key)
        noperm(other.sadd, p1.cancel, ids[1])
        noperm(e.raw("producer-pa").hgetall, Keys("pa.p1").job("any"))
        noperm(e.raw("producer-pa").hgetall, Keys("pa.p1", 1).job("any"))
    finally:
        for close in e.closers:
            close()
        srv.cleanup()
