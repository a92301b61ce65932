"""deploy/k8s checked without a cluster: every overlay (and the components on top of one)
rendered by kustomize (`kubectl kustomize`, offline), every object validated against the
Kubernetes schemas of a current release (kubernetes-validate, strict: an unknown field is
an error), the CRDs' objects (KEDA, Prometheus Operator) checked field by field against
what those controllers read; then the commands in the manifests run as written against
real processes, only paths and ports pointed at the test's own:

* the Redis StatefulSet's init container (`pagedq acl` over the password Secret's files)
  and redis-server with the StatefulSet's arguments; every pod's user logs in with the key
  it mounts; the readiness probe answers;
* every ScaledObject's stream, consumer group, address and user are the ones the target
  workers' own configuration makes (wire/keys.py through `pagedq worker`'s parser), and
  KEDA's commands (XLEN, XINFO GROUPS) as the `scaler` user see the jobs a real client
  queued, while that user cannot read one.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import kubernetes_validate as kv
import pytest
import redis
import yaml

from pagedq.admin import acl
from pagedq.cli import build_parser
from pagedq.producer import Client
from pagedq.wire import script
from pagedq.wire.keys import GROUP, Keys
from pagedq.wire.settings import Settings
from pagedq.worker.cli import check_config
from pagedq.worker.redis_server import free_port
from tests.queue_helpers import move
from tests.test_compose import dashboard, promql_metrics, redis7
from tests.waiting import until

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu")
CRD_KINDS = {"ScaledObject", "TriggerAuthentication", "ServiceMonitor"}
# what KEDA's redis-streams scaler reads from a trigger's metadata (KEDA 2.12+ docs)
KEDA_REDIS_STREAMS_KEYS = {
    "address", "addressFromEnv", "host", "hostFromEnv", "port", "portFromEnv", "username",
    "usernameFromEnv", "passwordFromEnv", "stream", "consumerGroup", "pendingEntriesCount",
    "streamLength", "lagCount", "activationLagCount", "databaseIndex", "enableTLS",
    "unsafeSsl"}
# KEDA's Redis Lists scaler (type redis): the inboxes' length
KEDA_REDIS_LISTS_KEYS = {
    "address", "addressFromEnv", "host", "hostFromEnv", "port", "portFromEnv", "username",
    "usernameFromEnv", "passwordFromEnv", "listName", "listLength", "activationListLength",
    "databaseIndex", "enableTLS", "unsafeSsl"}
KUBECTL = shutil.which("kubectl")
needs_kustomize = pytest.mark.skipif(KUBECTL is None, reason="kubectl (kustomize) not installed")


# ---------------------------------------------------------------- rendering

def kustomize(path: Path) -> list[dict]:
    out = subprocess.run([KUBECTL, "kustomize", str(path)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def on_top(tmp: Path, overlay: str, component: str) -> list[dict]:
    """An overlay with a component on top, as docs/deployment.md tells users to write it."""
    tmp.mkdir(parents=True, exist_ok=True)
    rel = os.path.relpath(K8S, tmp)
    (tmp / "kustomization.yaml").write_text(
        f"resources: [{rel}/overlays/{overlay}]\ncomponents: [{rel}/components/{component}]\n")
    return kustomize(tmp)


@pytest.fixture(scope="module")
def renders(tmp_path_factory) -> dict[str, list[dict]]:
    if KUBECTL is None:
        pytest.skip("kubectl (kustomize) not installed")
    tmp = tmp_path_factory.mktemp("k8s")
    out = {o: kustomize(K8S / "overlays" / o) for o in OVERLAYS}
    out["gpu+models-s3"] = on_top(tmp / "s3", "gpu", "models-s3")
    out["cpu+external-redis"] = on_top(tmp / "ext", "cpu", "external-redis")
    return out


def find(docs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]


def one(docs: list[dict], kind: str, name: str) -> dict:
    (d,) = find(docs, kind, name)
    return d


def raw_objects() -> list[tuple[Path, dict]]:
    """Every complete object in the YAML files under deploy/k8s (not the kustomizations)."""
    out = []
    for f in sorted(K8S.rglob("*.yaml")):
        for d in yaml.safe_load_all(f.read_text()):
            if d and "metadata" in d and d.get("kind") not in ("Kustomization", "Component"):
                out.append((f, d))
    return out


# ---------------------------------------------------------------- schemas

def validate(doc: dict) -> None:
    kv.validate(doc, kv.latest_version(), strict=True)


def test_every_object_validates_against_a_current_release():
    assert tuple(map(int, kv.latest_version().split(".")[:2])) >= (1, 33)
    seen = set()
    for f, d in raw_objects():
        if d["kind"] not in CRD_KINDS:
            try:
                validate(d)
            except kv.ValidationError as e:
                pytest.fail(f"{f.relative_to(ROOT)}: {d['kind']}: {e.message}")
            seen.add(d["kind"])
    assert {"StatefulSet", "Deployment", "Service", "Ingress", "NetworkPolicy",
            "PersistentVolume", "PersistentVolumeClaim", "ConfigMap"} <= seen
    # strict: a misspelt field fails (the check can fail)
    _, dep = next((f, d) for f, d in raw_objects() if d["kind"] == "Deployment")
    bad = json.loads(json.dumps(dep))
    bad["spec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"
    with pytest.raises(kv.ValidationError):
        validate(bad)


@needs_kustomize
def test_every_rendered_object_validates(renders):
    for name, docs in renders.items():
        kinds = {d["kind"] for d in docs}
        assert kinds & CRD_KINDS == CRD_KINDS, name
        for d in docs:
            if d["kind"] in CRD_KINDS:
                check_crd_object(d)
            else:
                try:
                    validate(d)
                except kv.ValidationError as e:
                    pytest.fail(f"{name}: {d['kind']} {d['metadata']['name']}: {e.message}")
            if d["kind"] not in ("Namespace", "PersistentVolume"):
                assert d["metadata"].get("namespace") == "pagedq", (name, d["kind"])


def check_crd_object(d: dict) -> None:
    """The fields of KEDA's and the Prometheus Operator's objects that pagedq uses, as
    their controllers read them."""
    spec = d["spec"]
    if d["kind"] == "ScaledObject":
        assert d["apiVersion"] == "keda.sh/v1alpha1"
        assert set(spec) <= {"scaleTargetRef", "minReplicaCount", "maxReplicaCount",
                             "pollingInterval", "cooldownPeriod", "advanced", "triggers"}
        assert spec["scaleTargetRef"]["name"] and spec["triggers"]
        assert 0 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
        for t in spec["triggers"]:
            assert t["type"] in ("redis-streams", "redis") and set(t) <= {
                "type", "name", "metadata", "authenticationRef"}
            md = t["metadata"]
            allowed = KEDA_REDIS_STREAMS_KEYS if t["type"] == "redis-streams" else \
                KEDA_REDIS_LISTS_KEYS
            assert set(md) <= allowed, set(md) - allowed
            assert all(isinstance(v, str) for v in md.values()), md  # KEDA takes strings
            if t["type"] == "redis":
                assert {"listName", "listLength"} <= set(md), md
                continue
            # KEDA's mode: a consumerGroup makes it lag (lagCount) or pending entries;
            # without one, the stream's length: streamLength with a group would be ignored
            if "streamLength" in md:
                assert "consumerGroup" not in md, md
            if {"lagCount", "pendingEntriesCount"} & set(md):
                assert "consumerGroup" in md, md
    elif d["kind"] == "TriggerAuthentication":
        assert d["apiVersion"] == "keda.sh/v1alpha1"
        for ref in spec["secretTargetRef"]:
            assert set(ref) == {"parameter", "name", "key"}
            assert ref["parameter"] in {"username", "password", "tls", "ca", "cert", "key"}
    else:
        assert d["apiVersion"] == "monitoring.coreos.com/v1"
        assert spec["selector"]["matchLabels"] and spec["endpoints"]


# ---------------------------------------------------------------- configuration

def container(obj: dict, name: str | None = None) -> dict:
    cs = obj["spec"]["template"]["spec"]["containers"]
    return cs[0] if name is None else next(c for c in cs if c["name"] == name)


def pod_env(docs: list[dict], c: dict) -> dict[str, str]:
    """A container's environment: its ConfigMaps (envFrom), then its own values."""
    env: dict[str, str] = {}
    for src in c.get("envFrom", []):
        if "configMapRef" in src:
            env.update(one(docs, "ConfigMap", src["configMapRef"]["name"])["data"])
    env.update({e["name"]: e["value"] for e in c.get("env", []) if "value" in e})
    return env


def password_key(obj: dict, c: dict) -> str:
    """The key of pagedq-redis-passwords a container reads as its password file."""
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    for v in obj["spec"]["template"]["spec"]["volumes"]:
        sec = v.get("secret")
        if sec and sec["secretName"] == "pagedq-redis-passwords" and v["name"] in mounts:
            (item,) = sec["items"]
            env = {e["name"]: e["value"] for e in c["env"]}
            assert env["PAGEDQ_REDIS_PASSWORD_FILE"] == f"{mounts[v['name']]}/{item['path']}"
            return item["key"]
    raise AssertionError(f"{obj['metadata']['name']} mounts no password")


def worker_config(docs: list[dict], dep: dict, monkeypatch, tmp_path: Path):
    """What `pagedq worker` makes of a worker Deployment's args and environment."""
    c = container(dep, "worker")
    env = pod_env(docs, c)
    pw = tmp_path / "password"
    pw.write_text("x" * 20)
    env["PAGEDQ_REDIS_PASSWORD_FILE"] = str(pw)  # the mounted Secret, here
    for k in [k for k in os.environ if k.startswith("PAGEDQ_")]:
        monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    args = build_parser().parse_args(c["args"])
    assert args.command == "worker"
    return check_config(args)


@needs_kustomize
def test_scaled_objects_name_what_the_workers_serve(renders, monkeypatch, tmp_path):
    users = {u.name: u for u in acl.users(["pagedq"])}
    for name, docs in renders.items():
        auth = one(docs, "TriggerAuthentication", "pagedq-keda-redis")
        refs = {r["parameter"]: r for r in auth["spec"]["secretTargetRef"]}
        user = one(docs, "Secret", refs["username"]["name"])["stringData"]["username"]
        assert users[user].role == "scaler" and refs["password"] == {
            "parameter": "password", "name": "pagedq-redis-passwords", "key": user}
        lanes_seen = set()
        for so in find(docs, "ScaledObject"):
            dep = one(docs, "Deployment", so["spec"]["scaleTargetRef"]["name"])
            cfg = worker_config(docs, dep, monkeypatch, tmp_path)
            s, lane = cfg.service, dep["metadata"]["labels"]["pagedq.dev/lane"]
            assert s.lanes[0] == lane, (name, s.lanes)  # the lane it scales comes first
            lanes_seen.add(lane)
            env = pod_env(docs, container(dep, "worker"))
            for t in so["spec"]["triggers"]:
                md = t["metadata"]
                if t["type"] == "redis":  # KEDA's Redis Lists scaler: the lane's inbox
                    assert md["listName"] == Keys(s.prefix).inbox(s.model, lane), (name, md)
                else:
                    assert md["stream"] == Keys(s.prefix).jobs(s.model, lane), (name, md)
                assert md.get("consumerGroup", GROUP) == GROUP
                assert t["authenticationRef"]["name"] == auth["metadata"]["name"]
                check_address(docs, env[md["addressFromEnv"]], s.redis_url)
                if "streamLength" in md:  # jobs per worker: its seats
                    assert int(md["streamLength"]) == cfg.worker.max_num_seqs, name
            # scaled from zero on the inbox: no worker moves its jobs into the stream then
            assert so["spec"]["minReplicaCount"] or any(
                t["type"] == "redis" for t in so["spec"]["triggers"]), name
            floor = so["spec"]["minReplicaCount"]
            assert floor == (0 if lane == "batch" else 1), (name, so["metadata"]["name"])
        assert lanes_seen == {"interactive", "batch"}, name
        # the gateway's default model is the one the workers serve
        gw = container(one(docs, "Deployment", "pagedq-gateway"))
        model = gw["args"][gw["args"].index("--model") + 1]
        assert model == s.model and f"-{s.model}-" in so["metadata"]["name"]


def check_address(docs: list[dict], address: str, url: str) -> None:
    """KEDA's host:port is the workers' Redis: the same host (the Service's full name, as
    KEDA's operator runs in another namespace) and port."""
    host, _, port = address.rpartition(":")
    u = urlparse(url)
    assert int(port) == (u.port or 6379)
    svc = find(docs, "Service", "pagedq-redis")
    if not svc:  # components/external-redis
        assert host == u.hostname
        return
    (svc,) = svc
    assert u.hostname == svc["metadata"]["name"]
    assert host == f"{u.hostname}.{svc['metadata']['namespace']}.svc.cluster.local"
    assert int(port) in [p["port"] for p in svc["spec"]["ports"]]


@needs_kustomize
def test_every_pod_logs_in_as_its_own_acl_user(renders, monkeypatch, tmp_path):
    for name, docs in renders.items():
        prefix = one(docs, "ConfigMap", "pagedq-config")["data"]["PAGEDQ_PREFIX"]
        names = {u.name for u in acl.users([prefix])}
        pods = {d["metadata"]["name"]: d for d in docs
                if d["kind"] in ("Deployment", "StatefulSet")}
        users = {}
        for dep_name, dep in pods.items():
            for c in dep["spec"]["template"]["spec"]["containers"]:
                env = pod_env(docs, c)
                if "PAGEDQ_REDIS_USERNAME" in env:
                    key = password_key(dep, c)
                    assert env["PAGEDQ_REDIS_USERNAME"] == key and key in names, \
                        (name, dep_name)
                    users[dep_name] = key
        assert users["pagedq-batch-worker"] == f"batch-{prefix}"
        assert users["pagedq-gateway"] == "gateway"
        assert {users[n] for n in pods if n.startswith("pagedq-worker-")} == {"worker"}


@needs_kustomize
def test_workers_drain_within_their_grace_period_and_probe_health(renders, monkeypatch,
                                                                   tmp_path):
    for name, docs in renders.items():
        for dep in find(docs, "Deployment"):
            if dep["metadata"]["labels"].get("app.kubernetes.io/component") != "worker":
                continue
            pod, c = dep["spec"]["template"]["spec"], container(dep, "worker")
            cfg = worker_config(docs, dep, monkeypatch, tmp_path)
            assert pod["terminationGracePeriodSeconds"] > cfg.service.drain_timeout_s + 10
            port = {p["name"]: p["containerPort"] for p in c["ports"]}["metrics"]
            assert port == cfg.service.metrics_port and cfg.service.metrics_host == "0.0.0.0"
            assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
            assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
            assert c["startupProbe"]["httpGet"]["path"] == "/healthz"
            start = c["startupProbe"]
            assert start["periodSeconds"] * start["failureThreshold"] >= 600  # model load
            if name.startswith("gpu"):
                for part in ("requests", "limits"):
                    assert c["resources"][part]["nvidia.com/gpu"] == 1
                assert cfg.worker.device == "cuda" and c["image"].endswith("pagedq:gpu")
                mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
                assert mounts["/models"].get("readOnly") and \
                    cfg.worker.model.startswith("/models/")
                vol = next(v for v in pod["volumes"] if v["name"] == "models")
                if name == "gpu":
                    assert vol["persistentVolumeClaim"]["claimName"] == "pagedq-models"
                else:  # synced from S3 into the pod by its init container
                    (sync,) = pod["initContainers"]
                    assert "emptyDir" in vol and "persistentVolumeClaim" not in vol
                    assert sync["args"][:2] == ["s3", "sync"] and sync["args"][3] == \
                        cfg.worker.model
            else:
                assert cfg.worker.device == "cpu" and cfg.worker.model == "smollm2"
        if name == "gpu":
            pvc = one(docs, "PersistentVolumeClaim", "pagedq-models")
            assert pvc["spec"]["accessModes"] == ["ReadOnlyMany"]
            assert one(docs, "PersistentVolume", pvc["spec"]["volumeName"])["spec"]["nfs"]
        if name == "gpu+models-s3":
            assert not find(docs, "PersistentVolumeClaim", "pagedq-models")


@needs_kustomize
def test_every_container_runs_restricted(renders):
    for name, docs in renders.items():
        for d in docs:
            if d["kind"] not in ("Deployment", "StatefulSet"):
                continue
            pod = d["spec"]["template"]["spec"]
            ctx = pod["securityContext"]
            assert ctx["runAsNonRoot"] and ctx["runAsUser"] >= 10000, d["metadata"]["name"]
            assert ctx["seccompProfile"]["type"] == "RuntimeDefault"
            assert pod["automountServiceAccountToken"] is False
            for c in pod["containers"] + pod.get("initContainers", []):
                sc = c["securityContext"]
                assert sc["allowPrivilegeEscalation"] is False, (name, c["name"])
                assert sc["readOnlyRootFilesystem"] and sc["capabilities"]["drop"] == ["ALL"]
                assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
        ing = one(docs, "Ingress", "pagedq-gateway")
        assert ing["spec"]["ingressClassName"] == "nginx" and ing["spec"]["tls"][0]["secretName"]
        ann = ing["metadata"]["annotations"]
        assert ann["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"  # streams
        backend = ing["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
        svc = one(docs, "Service", backend["name"])
        assert backend["port"]["name"] in [p["name"] for p in svc["spec"]["ports"]]
        gw = one(docs, "Deployment", "pagedq-gateway")
        assert container(gw)["lifecycle"]["preStop"]
        args = build_parser().parse_args(container(gw)["args"])
        assert (args.command, args.auth, args.host) == ("gateway", "on", "0.0.0.0")
        assert str(args.port) == str(container(gw)["ports"][0]["containerPort"])


@needs_kustomize
def test_monitoring_scrapes_the_workers_and_shows_the_articles_points(renders):
    docs = renders["gpu"]
    sm = one(docs, "ServiceMonitor", "pagedq-workers")
    metrics = [s for s in find(docs, "Service") if all(
        s["metadata"]["labels"].get(k) == v for k, v in sm["spec"]["selector"]["matchLabels"]
        .items())]
    assert {s["metadata"]["name"] for s in metrics} == {"pagedq-worker-metrics-interactive",
                                                        "pagedq-worker-metrics-batch"}
    for s in metrics:
        assert sm["spec"]["endpoints"][0]["port"] in [p["name"] for p in s["spec"]["ports"]]
    cm = one(docs, "ConfigMap", "pagedq-grafana-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["pagedq.json"]) == dashboard()  # the compose stack's file
    # the article's monitoring points, each on a panel
    panels = {m: p["title"] for p in dashboard()["panels"] for t in p["targets"]
              for m in promql_metrics(t["expr"])}
    for point, metric in {"running requests": "num_requests_running",
                          "KV cache usage": "kv_cache_usage_perc",
                          "queue wait": "request_queue_time_seconds_bucket",
                          "requests/s": "request_success_total",
                          "latency": "e2e_request_latency_seconds_bucket",
                          "GPU utilisation": "gpu_utilization_perc"}.items():
        assert f"pagedq:{metric}" in panels, point


# ---------------------------------------------------------------- running them

@needs_kustomize
def test_redis_with_the_generated_acl_serves_every_user_and_keda_reads_the_queue(
        renders, tmp_path):
    docs = renders["cpu"]
    sts = one(docs, "StatefulSet", "pagedq-redis")
    init = next(c for c in sts["spec"]["template"]["spec"]["initContainers"]
                if c["name"] == "acl")
    env = {**os.environ, "PYTHONPATH": str(ROOT), **pod_env(docs, init)}
    # docs/deployment.md: the passwords, once, into a folder that becomes the Secret
    secrets = tmp_path / "pagedq-secrets"
    made = subprocess.run([sys.executable, "-m", "pagedq", "acl", "--secrets-dir", str(secrets),
                           "-o", os.devnull], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert made.returncode == 0, made.stderr
    # the init container, as written: the Secret mounted at its path, the emptyDir here
    mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    args = [a.replace(mounts["passwords"], str(secrets)).replace(mounts["acl"], str(tmp_path))
            for a in init["args"]]
    gen = subprocess.run([sys.executable, "-m", "pagedq", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert gen.returncode == 0, gen.stderr
    # redis-server with the StatefulSet's arguments
    c = container(sts, "redis")
    cmd = [a.replace("/acl/", f"{tmp_path}/") for a in c["args"]]
    assert cmd[0] == "redis-server" and cmd[cmd.index("--dir") + 1] == "/data"
    data = tmp_path / "data"
    data.mkdir()
    cmd[cmd.index("--dir") + 1] = str(data)
    port = free_port()
    proc = subprocess.Popen([redis7(), *cmd[1:], "--port", str(port), "--bind", "127.0.0.1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        def pw(user: str) -> str:
            return (secrets / user).read_text()

        def conn(user: str) -> redis.Redis:
            return redis.Redis(port=port, username=user, password=pw(user),
                               decode_responses=True)
        admin = conn("admin")
        until(lambda: _pings(admin), "redis-server to answer", 15)
        assert admin.config_get("appendonly")["appendonly"] == "yes"
        assert admin.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
        probe = c["readinessProbe"]["exec"]["command"]
        assert probe[:2] == ["sh", "-c"]
        ready = subprocess.run(["sh", "-c", probe[2].replace("redis-cli", f"redis-cli -p {port}",
                                                              1)], timeout=30)
        assert ready.returncode == 0  # the unauthenticated PING of the probe
        for dep in ("pagedq-worker-interactive", "pagedq-gateway", "pagedq-batch-worker"):
            d = one(docs, "Deployment", dep)
            assert conn(password_key(d, container(d))).ping(), dep
        # a producer queues jobs on both lanes; no worker runs (pagedq's functions loaded
        # as a worker does at its start)
        script.load_library(conn("worker"))
        s = Settings(redis_url=f"redis://127.0.0.1:{port}/0", prefix="pagedq", model="smollm2",
                     redis_username="producer-pagedq", redis_password=pw("producer-pagedq"))
        with Client(settings=s) as cl:
            for _ in range(3):
                cl.submit("hi", max_tokens=4)
            for _ in range(2):
                cl.submit("bulk", max_tokens=4, lane="batch")
        scaler = conn("scaler")
        want = {"interactive": 3, "batch": 2}
        # what KEDA's scalers send, as their user: the jobs wait in the inboxes (LLEN) until
        # a worker's read moves them into the streams (XLEN, the group's lag)
        for moved in (False, True):
            for so in find(docs, "ScaledObject"):
                for t in so["spec"]["triggers"]:
                    md = t["metadata"]
                    key = md.get("listName") or md["stream"]
                    n = want[key.rsplit(":", 1)[1]]
                    if t["type"] == "redis":
                        assert scaler.llen(key) == (0 if moved else n)
                        continue
                    assert scaler.xlen(key) == (n if moved else 0)
                    if "consumerGroup" in md and moved:
                        (g,) = [g for g in scaler.xinfo_groups(key)
                                if g["name"] == md["consumerGroup"]]
                        assert g["lag"] == n and g["pending"] == 0
                        assert scaler.xpending(key, md["consumerGroup"])["pending"] == 0
            for lane in want:  # a worker's read, as the worker user
                move(conn("worker"), Keys("pagedq"), "smollm2", lane)
        stream = Keys("pagedq").jobs("smollm2", "interactive")
        for denied in (lambda: scaler.xrange(stream), lambda: scaler.get("x"),
                       lambda: scaler.xreadgroup(GROUP, "c", {stream: ">"})):
            with pytest.raises(redis.exceptions.NoPermissionError):
                denied()  # no prompt leaves the queue for the autoscaler
    finally:
        proc.kill()
        proc.wait()


def _pings(r: redis.Redis) -> bool:
    try:
        return r.ping()
    except redis.ConnectionError:
        return False


def test_the_images_are_the_dockerfiles_variants():
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r'"\$VARIANT" = client \]; then pip install "\.\[gateway\]"', text)
    for f, d in raw_objects():
        spec = d.get("spec", {}).get("template", {}).get("spec", {})
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            if "pagedq" in c["image"]:
                assert c["image"] in ("pagedq:cpu", "pagedq:gpu", "pagedq:client"), f
