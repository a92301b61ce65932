"""docker-compose.yml is checked without Docker: parsed, and its worker command is run
as-is (Redis URL pointed at a test server) against a real redis-server."""
from __future__ import annotations

import os
import time

import yaml

from producer import Client
from tests.worker_proc import ROOT, WorkerProc
from worker.cli import build_parser

COMPOSE = os.path.join(ROOT, "docker-compose.yml")


def _compose() -> dict:
    with open(COMPOSE) as f:
        return yaml.safe_load(f)


def test_compose_file_is_well_formed():
    c = _compose()
    assert set(c["services"]) >= {"redis", "worker"}
    redis_cmd = c["services"]["redis"]["command"]
    assert "--appendonly" in redis_cmd and redis_cmd[redis_cmd.index("--appendonly") + 1] == "yes"
    worker = c["services"]["worker"]
    assert worker["depends_on"] == ["redis"]
    args = build_parser().parse_args(worker["command"])
    assert args.command == "worker" and args.model == "smollm2"
    assert args.redis_url == "redis://redis:6379/0"


def test_compose_worker_command_serves_a_job(shared_redis_server):
    cmd = list(_compose()["services"]["worker"]["command"])
    cmd[cmd.index("--redis-url") + 1] = shared_redis_server.url
    i = cmd.index("worker")
    prefix = f"compose{time.time_ns()}"
    w = WorkerProc(shared_redis_server.url, prefix)
    w.extra = cmd[i + 1:]  # the compose service's own worker options
    w.model = cmd[cmd.index("--model") + 1]
    w.start()
    try:
        with Client(shared_redis_server.url, prefix=prefix, model="smollm2") as c:
            jid = c.submit("Say hi.", max_tokens=3, temperature=0.0, ignore_eos=True)
            assert c.result(jid, timeout=120).status == "finished"
    finally:
        w.stop()
