"""The deployment stack (docker-compose.yml, Dockerfile, .dockerignore, deploy/) checked
without Docker: every file is parsed, and the commands in them run as written, with only
container paths, hosts and ports pointed at the test's own, against real processes:

* redis-server with the compose service's arguments and an ACL file made by `pagedq acl`
  (the documented first-start step), and the compose healthcheck against it;
* the `worker` service's command and environment (model swapped for a tiny one, --device
  cpu) serving a job over its ACL user; its /metrics scraped for the names every Grafana
  panel uses; /healthz, /readyz and the image's probe; a drain seen on /readyz;
* the `worker-cpu` service's command as it is (bundled SmolLM2) serving a job, then a
  wedged engine step seen on /healthz (503) before the watchdog ends the process;
* the `batch-worker` service's command and its healthcheck, before, during and after.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import tomllib
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import redis
import yaml

from pagedq.batch.settings import BatchSettings
from pagedq.cli import build_parser
from pagedq.producer import Client
from pagedq.wire.settings import Settings
from pagedq.worker.names import served_name
from pagedq.worker.redis_server import free_port
from tests.waiting import until

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
PREFIX = "pagedq"  # the compose default (PAGEDQ_PREFIX unset)
WORKER_SERVICES = ("worker", "worker-cpu")

# ---------------------------------------------------------------- reading the files

_VAR = re.compile(r"\$\{(\w+)(?:(:?[-?])([^}]*))?\}")


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error} substitution."""
    def sub(m: re.Match) -> str:
        name, op, arg = m[1], m[2], m[3]
        val = env.get(name)
        if op == ":-":
            return val or arg
        if op == "-":
            return arg if val is None else val
        if op in (":?", "?"):
            if not val:
                raise KeyError(f"{name}: {arg}")
            return val
        return val or ""
    return _VAR.sub(sub, text)


def _resolve(obj, env: dict[str, str]):
    if isinstance(obj, str):
        return interpolate(obj, env)
    if isinstance(obj, list):
        return [_resolve(x, env) for x in obj]
    if isinstance(obj, dict):
        return {k: _resolve(v, env) for k, v in obj.items()}
    return obj


def compose(env: dict[str, str] | None = None) -> dict:
    """docker-compose.yml with its anchors merged and variables at their defaults."""
    with open(ROOT / "docker-compose.yml") as f:
        return _resolve(yaml.safe_load(f), env or {})


def service(name: str) -> dict:
    return compose()["services"][name]


def env_of(svc: dict) -> dict[str, str]:
    e = svc.get("environment") or {}
    if isinstance(e, list):
        e = dict(x.split("=", 1) for x in e)
    return {k: str(v) for k, v in e.items()}


def seconds(duration: str) -> float:
    """A compose duration: 75s, 1m30s, 10m."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s|us)", str(duration))
    assert parts and "".join(a + b for a, b in parts) == str(duration), duration
    unit = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}
    return sum(float(a) * unit[b] for a, b in parts)


def mount(svc: dict, source: str) -> str:
    """The container path a host path of ``svc``'s volumes is mounted at."""
    for v in svc.get("volumes", []):
        src, dst = v.split(":")[:2]
        if os.path.normpath(src) == os.path.normpath(source):
            return dst
    raise AssertionError(f"{source} is not mounted")


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), " ".join(rest.split())))
    return out


def stages() -> dict[str, list[tuple[str, str]]]:
    out: dict[str, list] = {}
    cur = "(global)"
    for ins, arg in dockerfile():
        if ins == "FROM":
            cur = arg.split(" AS ")[-1].strip() if " AS " in arg else arg
            out[cur] = [(ins, arg)]
        else:
            out.setdefault(cur, []).append((ins, arg))
    return out


def dockerignored(path: str) -> bool:
    """Docker's .dockerignore rule: the last pattern matching the path or one of its parent
    folders decides; ``!`` re-includes; ``*`` stays within a folder, ``**`` crosses them."""
    rules = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        neg = line.startswith("!")
        pat = line[1:] if neg else line
        rx = re.escape(pat.strip("/")).replace(r"\*\*/", "(?:.*/)?").replace(r"\*\*", ".*")
        rx = rx.replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        rules.append((re.compile(rx + r"\Z"), neg))
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    ignored = False
    for rx, neg in rules:
        if any(rx.match(p) for p in prefixes):
            ignored = not neg
    return ignored


# ---------------------------------------------------------------- PromQL

_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or",
                 "unless", "bool", "offset"}


def promql_metrics(expr: str) -> set[str]:
    """The metric names an expression reads (functions, keywords, labels, strings and
    ranges taken out)."""
    e = re.sub(r'"[^"]*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", "", e)
    e = re.sub(r"\[[^\]]*\]", "", e)
    e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    out = set()
    for m in re.finditer(r"(?<![\w$.])[A-Za-z_:][\w:]*", e):
        if m[0] in _PROMQL_WORDS or e[m.end():].lstrip().startswith("("):
            continue
        out.add(m[0])
    return out


def alert_rules() -> list[dict]:
    with open(DEPLOY / "prometheus" / "alerts.yml") as f:
        return [r for g in yaml.safe_load(f)["groups"] for r in g["rules"]]


def dashboard() -> dict:
    return json.loads((DEPLOY / "grafana" / "dashboards" / "pagedq.json").read_text())


def scrape_names(body: str) -> tuple[set[str], set[str]]:
    """(names declared by # TYPE lines, with the series names their type implies; names
    that have a sample)."""
    declared, sampled = set(), set()
    suffixes = {"histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count", "")}
    for line in body.splitlines():
        if line.startswith("# TYPE "):  # a counter's TYPE line names its _total series
            _, _, name, kind = line.split()
            declared |= {name + s for s in suffixes.get(kind, ("",))}
        elif line and not line.startswith("#"):
            sampled.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return declared, sampled


# what Prometheus 2.x sends when it scrapes (OpenMetrics first)
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
                     "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


def get(url: str, timeout: float = 5.0, accept: str | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def run_probe(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """A healthcheck ``["CMD", "python", "-m", ...]`` as Docker runs it, with this Python."""
    assert cmd[0] == "CMD" and cmd[1] == "python", cmd
    return subprocess.run([sys.executable, *cmd[2:]], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT), **env})


# ---------------------------------------------------------------- files alone

def test_compose_services_restart_healthcheck_and_scale():
    c = compose()
    svcs = c["services"]
    assert set(svcs) >= {"redis", "worker", "worker-cpu", "batch-worker", "prometheus",
                         "grafana"}
    for name, svc in svcs.items():  # every service is long-running
        assert svc.get("restart") == "unless-stopped", name
        assert svc.get("healthcheck", {}).get("test"), name
    drain = float(env_of(svcs["worker"])["PAGEDQ_DRAIN_TIMEOUT_S"])
    for name in WORKER_SERVICES:
        w = svcs[name]
        assert "container_name" not in w and "ports" not in w, f"{name} must scale"
        assert seconds(w["stop_grace_period"]) > float(env_of(w)["PAGEDQ_DRAIN_TIMEOUT_S"])
        assert w["depends_on"]["redis"]["condition"] == "service_healthy"
        assert env_of(w)["PAGEDQ_METRICS_HOST"] == "0.0.0.0"
    assert drain > 0
    gpu = svcs["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert gpu == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert "profiles" not in svcs["worker"] and svcs["worker-cpu"]["profiles"] == ["cpu"]
    assert "./models:/models:ro" in svcs["worker"]["volumes"]  # MODELS_DIR unset: read-only
    for secret in c["secrets"].values():  # the files `pagedq acl --secrets-dir` writes
        assert os.path.dirname(secret["file"]) == "./deploy/secrets"


def test_every_service_command_parses_with_the_real_cli():
    svcs = compose()["services"]
    gpu = build_parser().parse_args(svcs["worker"]["command"])
    assert gpu.command == "worker" and gpu.device == "cuda"
    assert gpu.model == "/models/model"  # MODEL_PATH unset
    gpu = build_parser().parse_args(compose({"MODEL_PATH": "Qwen3-0.6B"})["services"]["worker"]
                                    ["command"])
    assert gpu.model == "/models/Qwen3-0.6B" and served_name(gpu.model, None) == "Qwen3-0.6B"
    cpu = build_parser().parse_args(svcs["worker-cpu"]["command"])
    assert (cpu.command, cpu.model, cpu.device) == ("worker", "smollm2", "cpu")
    batch = build_parser().parse_args(svcs["batch-worker"]["command"])
    assert (batch.command, batch.batch_command) == ("batch", "worker")
    assert svcs["redis"]["command"][0] == "redis-server"  # its options: test_redis_* below


def _known_env() -> set[str]:
    names = {f"PAGEDQ_{n.upper()}" for cls in (Settings, BatchSettings)
             for n in cls.model_fields}
    try:  # the worker's own settings (model, engine), where this tree has them
        from pagedq.worker.settings import WorkerSettings
    except ImportError:
        pass
    else:
        names |= {f"PAGEDQ_{n.upper()}" for n in WorkerSettings.model_fields}
    return names


def test_every_pagedq_variable_is_a_real_setting():
    known = _known_env()
    seen = set()
    for name, svc in compose()["services"].items():
        for var in env_of(svc):
            if var.startswith("PAGEDQ_"):
                seen.add(var)
                assert var in known, f"{name}: {var} is no setting"
    for ins, arg in dockerfile():
        if ins == "ENV":
            for var in re.findall(r"\b(PAGEDQ_\w+)=", arg):
                seen.add(var)
                assert var in known, f"Dockerfile: {var} is no setting"
    assert {"PAGEDQ_METRICS_PORT", "PAGEDQ_DRAIN_TIMEOUT_S", "PAGEDQ_HEALTH_MAX_SILENCE_S",
            "PAGEDQ_REDIS_PASSWORD_FILE", "PAGEDQ_BATCH_DIR"} <= seen


def test_prometheus_scrapes_every_worker_service_on_its_metrics_port():
    with open(DEPLOY / "prometheus" / "prometheus.yml") as f:
        prom = yaml.safe_load(f)
    assert prom["global"]["scrape_interval"]
    svcs = compose()["services"]
    targets = {}
    for job in prom["scrape_configs"]:
        for sd in job.get("dns_sd_configs", []):
            assert sd["type"] == "A"
            for name in sd["names"]:
                targets[name] = sd["port"]
    assert set(targets) == {*WORKER_SERVICES, "batch-worker"}, targets
    for name, port in targets.items():
        var = "PAGEDQ_BATCH_METRICS_PORT" if name == "batch-worker" else "PAGEDQ_METRICS_PORT"
        assert port == int(env_of(svcs[name])[var]), name
        assert str(port) in [str(p) for p in svcs[name]["expose"]]
    prom_svc = svcs["prometheus"]
    assert mount(prom_svc, "./deploy/prometheus/prometheus.yml") == \
        "/etc/prometheus/prometheus.yml"
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom_svc["command"]
    # the alerting rules: each file of rule_files mounted from deploy/prometheus/
    assert prom["rule_files"] == ["/etc/prometheus/alerts.yml"]
    assert mount(prom_svc, "./deploy/prometheus/alerts.yml") == prom["rule_files"][0]
    rules = alert_rules()
    assert {r["alert"] for r in rules} >= {
        "PagedqNoWorkerUp", "PagedqModelWithoutWorker", "PagedqFailureRate", "PagedqQueueWaitP99High",
        "PagedqDeadLettersGrowing", "PagedqOldestPendingEntry", "PagedqRedisFull",
        "PagedqWorkerRestarts", "PagedqBatchWorkerDown"}
    for r in rules:
        assert r["labels"]["severity"] in ("warning", "critical"), r["alert"]
        assert r["annotations"]["summary"] and promql_metrics(r["expr"]), r["alert"]


def test_grafana_provisioning_points_at_the_dashboard_and_prometheus():
    graf = service("grafana")
    prov = DEPLOY / "grafana" / "provisioning"
    assert mount(graf, "./deploy/grafana/provisioning") == "/etc/grafana/provisioning"
    with open(prov / "datasources" / "prometheus.yml") as f:
        (ds,) = yaml.safe_load(f)["datasources"]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090"
    with open(prov / "dashboards" / "pagedq.yml") as f:
        (provider,) = yaml.safe_load(f)["providers"]
    assert provider["options"]["path"] == mount(graf, "./deploy/grafana/dashboards")
    home = env_of(graf)["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == provider["options"]["path"] + "/pagedq.json"
    d = dashboard()
    assert d["uid"] == "pagedq" and d["panels"]
    for p in d["panels"]:
        assert p["datasource"]["uid"] == ds["uid"], p["title"]
        assert p["targets"] and p["description"], p["title"]
        assert all(t["datasource"]["uid"] == ds["uid"] for t in p["targets"])
    used = {m for p in d["panels"] for t in p["targets"] for m in promql_metrics(t["expr"])}
    # the panels the deployment doc promises
    for name in ("stream_length", "pending_count", "num_requests_running",
                 "num_requests_waiting", "kv_cache_usage_perc",
                 "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "request_queue_time_seconds_bucket", "generation_tokens_total",
                 "request_success_total", "gpu_utilization_perc", "gpu_memory_used_bytes",
                 "gpu_memory_reserved_bytes", "dlq_size", "reclaims_total"):
        assert f"pagedq:{name}" in used, name
    gpu_util = [p for p in d["panels"] if "gpu_utilization_perc" in json.dumps(p["targets"])]
    assert "nvidia-ml-py" in gpu_util[0]["description"]  # says when it has no data


def test_promql_metric_extraction():
    assert promql_metrics('histogram_quantile(0.95, sum by (le, lane) (rate('
                          'pagedq:ttft_bucket{lane="x"}[$__rate_interval])))') == {
        "pagedq:ttft_bucket"}
    assert promql_metrics("max by (lane) (a:b) - max by (lane) (c)") == {"a:b", "c"}
    assert promql_metrics("count(up == 1) or vector(0)") == {"up"}


def test_queue_gauges_are_taken_once_per_queue_before_any_sum():
    """Every worker of a queue exports the same series (labels prefix, model, lane:
    worker/liveness.py): a panel takes their max per queue first, or N workers would show
    N times the queue."""
    seen = 0
    for p in dashboard()["panels"]:
        for t in p["targets"]:
            for m in re.finditer(r"pagedq:(?:stream_length|pending_count|dlq_size)\b",
                                 t["expr"]):
                seen += 1
                assert t["expr"][:m.start()].endswith("max by (prefix, model, lane) ("), \
                    (p["title"], t["expr"])
    assert seen >= 4


def test_dockerfile_variants_user_healthchecks_and_copies():
    st = stages()
    glob = dict(a.split("=", 1) for i, a in st["(global)"] if i == "ARG" and "=" in a)
    assert glob["VARIANT"] == "cpu" and glob["PYTHON_IMAGE"] == "python:3.11-slim"
    assert {"base", "cpu", "gpu", "client", "final"} <= set(st)
    assert st["final"][0] == ("FROM", "${VARIANT} AS final")

    def args(stage: str) -> dict[str, str]:
        return {k: v.strip('"') for k, _, v in (a.partition("=") for i, a in st[stage]
                                                 if i == "ARG" and "=" in a)}

    assert args("cpu")["TORCH_INDEX_URL"].endswith("/whl/cpu")
    assert re.search(r"/whl/cu\d+$", args("gpu")["TORCH_INDEX_URL"])
    assert args("cpu")["TORCH_SPEC"] == args("gpu")["TORCH_SPEC"]
    for stage in ("cpu", "gpu"):
        assert any(i == "RUN" and '--index-url "$TORCH_INDEX_URL" "$TORCH_SPEC"' in a
                   for i, a in st[stage])
    assert any("nvidia-ml-py" in a for i, a in st["gpu"] if i == "RUN")
    assert not any("torch" in a.lower() for i, a in st["client"])
    users = [a for i, a in st["final"] if i == "USER"]
    assert users == ["pagedq"], users
    assert any(i == "RUN" and "useradd" in a and "--uid 10001" in a for i, a in st["base"])
    assert ("ENTRYPOINT", '["pagedq"]') in st["final"]
    for stage, probe in (("cpu", "pagedq.worker.healthcheck"), ("gpu", "pagedq.worker.healthcheck"),
                         ("client", "pagedq.batch.healthcheck")):
        (hc,) = [a for i, a in st[stage] if i == "HEALTHCHECK"]
        assert hc.endswith(f'CMD ["python", "-m", "{probe}"]'), hc
    copied = set()
    for i, a in st["final"]:
        if i == "COPY":
            *srcs, _dst = a.split()
            copied.update(srcs)
            for src in srcs:
                assert (ROOT / src).exists(), src
                assert not dockerignored(src), f"{src} is in .dockerignore"
    # every folder the distribution installs (pagedq, and pagedq.<name> from <name>/)
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert {"pagedq", *tool["package-dir"].values()} <= copied, copied
    # compose builds the same variants
    svcs = compose()["services"]
    assert {svcs[n]["build"]["args"]["VARIANT"] for n in ("worker", "worker-cpu",
                                                          "batch-worker")} == {"gpu", "cpu",
                                                                               "client"}


def test_dockerignore_keeps_out_the_venv_git_wheels_and_caches():
    for path in (".venv", ".venv/lib/python3.11/site-packages/torch/__init__.py", ".git/HEAD",
                 ".whl/site/redis/__init__.py", "dist/pagedq-0.3.0-py3-none-any.whl",
                 "producer/__pycache__/cli.cpython-311.pyc", "tests/test_e2e.py",
                 "bench/results/h200.json", ".pytest_cache/v/cache/nodeids",
                 "pagedq.egg-info/PKG-INFO", "deploy/secrets/worker", "deploy/redis/users.acl",
                 "models/Qwen3-0.6B/model.safetensors", ".env"):
        assert dockerignored(path), path
    for path in ("producer/client.py", "worker/service.py", "engine/llm_engine.py",
                 "kernels/__init__.py", "pyproject.toml", "README.md", "Dockerfile"):
        assert not dockerignored(path), path


# ---------------------------------------------------------------- the stack, running

def redis7() -> str:
    """A redis-server of 7.0 or later (the ACL file uses Redis 7 syntax; the image is 7.2)."""
    import shutil

    tried = []
    for cand in (shutil.which("redis-server"), "/usr/bin/redis-server",
                 "/usr/local/bin/redis-server"):
        if not cand or not os.path.exists(cand) or cand in tried:
            continue
        tried.append(cand)
        out = subprocess.run([cand, "--version"], capture_output=True, text=True).stdout
        m = re.search(r"v=(\d+)\.", out)
        if m and int(m[1]) >= 7:
            return cand
    raise RuntimeError(f"no redis-server >= 7.0 found (tried {tried}): apt-get install "
                       f"redis-server")


class Stack:
    """redis-server as the compose file runs it, with `pagedq acl`'s file and passwords."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.secrets = tmp, tmp / "secrets"
        self.procs: list[subprocess.Popen] = []
        self.logs: dict[int, Path] = {}

    def start_redis(self) -> None:
        acl_file = self.tmp / "users.acl"
        res = subprocess.run([sys.executable, "-m", "pagedq", "acl", "--secrets-dir",
                              str(self.secrets), "--default-user", "ping", "-o", str(acl_file)],
                             cwd=ROOT, capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert res.returncode == 0, res.stderr
        svc = service("redis")
        cmd = list(svc["command"])
        cmd[cmd.index(mount(svc, "./deploy/redis/users.acl"))] = str(acl_file)
        self.port = free_port()
        data = self.tmp / "data"
        data.mkdir()
        cmd = [redis7(), *cmd[1:], "--port", str(self.port), "--bind", "127.0.0.1",
               "--daemonize", "no", "--logfile", str(self.tmp / "redis.log")]
        self.redis_cmd = cmd
        self.procs.append(subprocess.Popen(cmd, cwd=data, stdout=subprocess.DEVNULL,
                                           stderr=subprocess.STDOUT))
        self.admin = redis.Redis(port=self.port, username="admin", password=self.password(
            "admin"), decode_responses=True)
        until(lambda: self._pings(), "redis-server to answer", 15)

    def _pings(self) -> bool:
        assert self.procs[0].poll() is None, (self.tmp / "redis.log").read_text()
        try:
            return self.admin.ping()
        except redis.ConnectionError:
            return False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def password(self, user: str) -> str:
        return (self.secrets / user).read_text().strip()

    def secret_file(self, svc: dict) -> str:
        """The host file of the service's one secret (compose mounts it at /run/secrets)."""
        (name,) = svc["secrets"]
        host = compose()["secrets"][name]["file"]
        return str(self.secrets / os.path.basename(host))

    def service_env(self, name: str, **over: str) -> dict[str, str]:
        svc = service(name)
        env = env_of(svc)
        assert env["PAGEDQ_REDIS_URL"] == "redis://redis:6379/0"
        assert env["PAGEDQ_REDIS_PASSWORD_FILE"] == f"/run/secrets/{svc['secrets'][0]}"
        env.update(PAGEDQ_REDIS_URL=self.url, PAGEDQ_REDIS_PASSWORD_FILE=self.secret_file(svc))
        return {**env, **over}

    def run(self, args: list[str], env: dict[str, str]) -> subprocess.Popen:
        """``pagedq ARGS`` (the image's ENTRYPOINT) with ``env``; output in a log file."""
        log = Path(tempfile.mktemp(prefix="pagedq-compose-", suffix=".log", dir=self.tmp))
        with open(log, "wb") as f:
            p = subprocess.Popen([sys.executable, "-m", "pagedq", *args], cwd=ROOT,
                                 stdout=f, stderr=subprocess.STDOUT,
                                 env={**os.environ, "PYTHONPATH": str(ROOT), **env})
        self.procs.append(p)
        self.logs[p.pid] = log
        return p

    def log(self, p: subprocess.Popen) -> str:
        return self.logs[p.pid].read_text(errors="replace")[-4000:]

    def client(self, model: str) -> Client:
        """As admin: the producer role's rights are tests/test_acl.py's; here the services'
        own users (worker, batch-<prefix>) are under test."""
        s = Settings(redis_url=self.url, prefix=PREFIX, model=model, redis_username="admin",
                     redis_password=self.password("admin"))
        return Client(settings=s)

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.kill()
                p.wait(30)


def wait_health(port: int, proc: subprocess.Popen, log, path: str = "readyz",
                timeout: float = 180.0) -> dict:
    def ready():
        assert proc.poll() is None, f"exited {proc.returncode}:\n{log()}"
        try:
            code, body = get(f"http://127.0.0.1:{port}/{path}", 2)
        except OSError:
            return None
        return json.loads(body) if code == 200 else None
    return until(ready, f"/{path} to answer 200", timeout, 0.2)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_dir):
    """redis-server as compose runs it, and the `worker` service's command on a tiny model
    (steps slowed a little, so a drain is long enough to watch)."""
    st = Stack(tmp_path_factory.mktemp("stack"))
    try:
        st.start_redis()
        svc = service("worker")
        cmd = list(svc["command"])
        cmd[cmd.index("--model") + 1] = tiny_dir  # instead of /models/$MODEL_PATH
        cmd[cmd.index("--device") + 1] = "cpu"
        st.metrics_port = free_port()
        env = st.service_env("worker", PAGEDQ_METRICS_PORT=str(st.metrics_port),
                             PAGEDQ_FAILPOINTS="step_sleep_s=0.02")
        st.worker = st.run(cmd, env)
        st.model = served_name(tiny_dir, None)
        wait_health(st.metrics_port, st.worker, lambda: st.log(st.worker))
        yield st
    finally:
        st.stop()


def test_redis_runs_with_the_compose_options_and_its_healthcheck_answers(stack):
    cfg = {k: v for k in ("appendonly", "appendfsync", "maxmemory-policy", "maxmemory")
           for k, v in stack.admin.config_get(k).items()}
    assert cfg == {"appendonly": "yes", "appendfsync": "everysec",
                   "maxmemory-policy": "noeviction", "maxmemory": "0"}
    assert stack.admin.config_get("aclfile")["aclfile"].endswith("users.acl")
    anonymous = redis.Redis(port=stack.port)
    assert anonymous.ping()  # `pagedq acl --default-user ping`: PING only, for healthchecks
    with pytest.raises(redis.exceptions.NoPermissionError):
        anonymous.get("x")
    test = service("redis")["healthcheck"]["test"]
    assert test[0] == "CMD-SHELL" and test[1].startswith("redis-cli ping")

    def health(port: int) -> int:
        return subprocess.run(["sh", "-c", test[1].replace("redis-cli", f"redis-cli -p {port}",
                                                           1)],
                              capture_output=True, timeout=30).returncode

    assert health(stack.port) == 0
    assert health(free_port()) != 0  # nothing listening: unhealthy


def test_worker_service_serves_a_job_through_its_acl_user(stack):
    with stack.client(stack.model) as c:
        jid = c.submit("Say hi.", max_tokens=4, temperature=0.0, ignore_eos=True)
        rec = c.result(jid, timeout=120)
    assert rec.status == "finished" and rec.usage.completion_tokens == 4


def test_every_dashboard_and_alert_metric_is_exported_by_the_worker(stack):
    with stack.client(stack.model) as c:  # one job, so every histogram has samples
        c.result(c.submit("metrics", max_tokens=3, ignore_eos=True), timeout=120)
    url = f"http://127.0.0.1:{stack.metrics_port}/metrics"

    def scraped():  # as Prometheus asks: colons must survive (no OpenMetrics escaping)
        declared, sampled = scrape_names(get(url, accept=PROMETHEUS_ACCEPT)[1])
        # (the queue gauges exist at 0 from the start: model_workers shows a read)
        return (declared, sampled) if 'pagedq:model_workers' in sampled else None
    declared, sampled = until(scraped, "the queue gauges read", 30, 0.5)  # every 5 s
    assert not [n for n in sampled if n.startswith("pagedq_")], "pagedq: became pagedq_"
    gpu = {n for n in declared if n.startswith("pagedq:gpu_")}
    assert gpu == {"pagedq:gpu_memory_allocated_bytes", "pagedq:gpu_memory_reserved_bytes",
                   "pagedq:gpu_memory_used_bytes", "pagedq:gpu_memory_total_bytes",
                   "pagedq:gpu_utilization_perc"}
    assert not gpu & sampled  # a CPU worker declares the GPU families, with no sample
    for p in dashboard()["panels"]:
        for t in p["targets"]:
            for name in promql_metrics(t["expr"]):
                assert name in declared, (p["title"], name)
                if name not in gpu:
                    assert name in sampled, (p["title"], name)
    for r in alert_rules():  # `up`: Prometheus's own series of each target it scrapes
        for name in promql_metrics(r["expr"]) - {"up"}:
            assert name in sampled, (r["alert"], name)
    for name in ("process_cpu_seconds_total", "process_resident_memory_bytes",
                 "process_open_fds", "process_start_time_seconds"):
        assert name in sampled, name


def test_health_endpoints_and_the_image_probe_on_a_live_worker(stack):
    for path in ("healthz", "readyz"):
        code, body = get(f"http://127.0.0.1:{stack.metrics_port}/{path}")
        doc = json.loads(body)
        assert code == 200 and doc["status"] == "ok" and doc["phase"] == "serving", doc
        assert doc["loop_silent_s"] < doc["max_silence_s"] == 60
    test = service("worker")["healthcheck"]["test"]
    assert test == service("worker-cpu")["healthcheck"]["test"]
    (image,) = [a for i, a in stages()["cpu"] if i == "HEALTHCHECK"]
    assert image.endswith("CMD " + json.dumps(test[1:]))  # the image's own probe is the same
    ok = run_probe(test, {"PAGEDQ_METRICS_PORT": str(stack.metrics_port)})
    assert ok.returncode == 0 and json.loads(ok.stdout)["status"] == "ok", ok
    down = run_probe(test, {"PAGEDQ_METRICS_PORT": str(free_port())})
    assert down.returncode == 1 and "no answer" in down.stdout, down
    unset = run_probe(test, {"PAGEDQ_METRICS_PORT": "0"})
    assert unset.returncode == 1 and "PAGEDQ_METRICS_PORT" in unset.stdout


def test_batch_worker_service_and_its_healthcheck(stack):
    svc = service("batch-worker")
    test = svc["healthcheck"]["test"]
    (image,) = [a for i, a in stages()["client"] if i == "HEALTHCHECK"]
    assert image.endswith("CMD " + json.dumps(test[1:]))
    queue = f"compose-{os.urandom(3).hex()}"
    env = stack.service_env("batch-worker", PAGEDQ_BATCH_DIR=str(stack.tmp / "batches"),
                            PAGEDQ_BATCH_QUEUE=queue)
    before = run_probe(test, env)
    assert before.returncode == 1 and "no rq worker" in before.stdout, before
    assert env["PAGEDQ_BATCH_METRICS_HOST"] == "0.0.0.0"
    port = free_port()  # the compose port, 9401, may be taken on this machine
    env.update(PAGEDQ_BATCH_METRICS_PORT=str(port), PAGEDQ_BATCH_METRICS_HOST="127.0.0.1")
    p = stack.run(svc["command"], env)
    until(lambda: run_probe(test, env).returncode == 0 or p.poll() is not None,
          "the batch worker's healthcheck to pass", 60, 0.5)
    assert p.poll() is None, stack.log(p)
    # what the compose Prometheus scrapes (its job pagedq-batch-worker)
    declared, _sampled = scrape_names(get(f"http://127.0.0.1:{port}/metrics",
                                          accept=PROMETHEUS_ACCEPT)[1])
    assert {"pagedq:batches", "pagedq:batch_requests", "pagedq:batch_rq_jobs",
            "process_resident_memory_bytes"} <= declared, declared
    p.send_signal(signal.SIGTERM)  # rq's warm shutdown unregisters the worker, in seconds
    assert p.wait(15) == 0, stack.log(p)  # (its pub/sub thread once held it up to 60 s)
    after = run_probe(test, env)
    assert after.returncode == 1 and "no rq worker" in after.stdout, after
    bad = run_probe(test, {**env, "PAGEDQ_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"})
    assert bad.returncode == 1 and "cannot read rq workers" in bad.stdout, bad


def test_worker_drain_is_live_but_not_ready(stack):
    """Runs last: SIGTERM drains the module's worker (one job running) and it exits 0."""
    port = stack.metrics_port
    with stack.client(stack.model) as c:
        jid = c.submit("a long one", max_tokens=120, ignore_eos=True)  # >= 2.4 s at 20 ms a step
        it = c.stream(jid, timeout=60)
        next(it)
        stack.worker.send_signal(signal.SIGTERM)
        drain = until(lambda: (lambda r: r if r[0] == 503 else None)(
            get(f"http://127.0.0.1:{port}/readyz")), "/readyz to say draining", 30)
        assert json.loads(drain[1])["status"] == "draining"
        code, body = get(f"http://127.0.0.1:{port}/healthz")
        assert code == 200 and json.loads(body)["phase"] == "draining"
        assert stack.worker.wait(60) == 0, stack.log(stack.worker)
        assert c.result(jid, timeout=10).status == "finished"


def test_worker_cpu_service_serves_then_healthz_reports_a_wedged_step(stack):
    """The laptop profile's command as it is (bundled SmolLM2); then a step that never
    ends (failpoint) turns /healthz to 503 within its bound, while the process lives on
    (the watchdog, set far above the bound here, would end it later)."""
    svc = service("worker-cpu")
    port = free_port()
    env = stack.service_env("worker-cpu", PAGEDQ_METRICS_PORT=str(port),
                            PAGEDQ_HEALTH_MAX_SILENCE_S="1", PAGEDQ_STEP_WATCHDOG_S="120",
                            PAGEDQ_FAILPOINTS="wedge_on_prompt=HANG")
    p = stack.run(svc["command"], env)
    wait_health(port, p, lambda: stack.log(p))
    with stack.client("smollm2") as c:
        ok = c.submit("Say hi.", max_tokens=3, temperature=0.0, ignore_eos=True)
        assert c.result(ok, timeout=120).status == "finished"
        c.submit("HANG here", max_tokens=3)
        code, body = until(lambda: (lambda r: r if r[0] == 503 else None)(
            get(f"http://127.0.0.1:{port}/healthz")), "/healthz to turn 503", 30)
    doc = json.loads(body)
    # wedged once the silence passed the 1 s bound; the body rounds it to 3 decimals
    assert doc["status"] == "wedged" and doc["loop_silent_s"] >= 1, doc
    assert "not run for" in doc["reason"]
    assert get(f"http://127.0.0.1:{port}/readyz")[0] == 503
    probe = run_probe(svc["healthcheck"]["test"], {"PAGEDQ_METRICS_PORT": str(port)})
    assert probe.returncode == 1 and json.loads(probe.stdout)["status"] == "wedged", probe
    assert p.poll() is None  # SIGSTOP would freeze the HTTP thread too; a wedge does not
    p.kill()
    p.wait(30)


def test_redis_server_refuses_an_unknown_option(tmp_path):
    """What makes the fixture's start of redis-server with the compose options a check of
    them: a misspelt option stops the real binary at once ('Bad directive')."""
    cmd = [a for a in service("redis")["command"][1:]]
    i = cmd.index("--aclfile")
    del cmd[i:i + 2]
    res = subprocess.run([redis7(), *cmd, "--appendfsnyc", "always", "--port", "0"],
                         capture_output=True, text=True, timeout=30, cwd=tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode != 0 and "Bad directive" in out and "appendfsnyc" in out, out


def test_compose_commands_split_like_a_shell():
    """No command hides two arguments in one string (compose does not split them)."""
    for name, svc in compose()["services"].items():
        cmd = svc.get("command")
        if isinstance(cmd, list):
            for a in cmd:
                assert shlex.split(a) == [a] or a == "", (name, a)
