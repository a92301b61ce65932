"""One configuration source for the worker (worker/config.py): flag > PAGEDQ_* environment >
YAML config file > default, for every service and engine setting; `pagedq config`; a bad
file, key or value is one `pagedq: ...` line and exit 78; docs/configuration.md lists every
setting; and a real worker started with nothing but `--config FILE` serves jobs with the
file's max_num_seqs and max_model_len."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import time
import typing
import uuid
from pathlib import Path

import pytest
import redis
from pydantic import SecretStr

from pagedq.cli import build_parser, main
from pagedq.producer import Client
from pagedq.wire.settings import Settings
from pagedq.worker.config import (
    FLAGGED,
    ConfigError,
    env_name,
    flag_name,
    resolve,
    sections,
    service_fields,
    yaml_keys,
)
from pagedq.worker.config_show import _text
from pagedq.worker.settings import ENGINE_FIELDS, WorkerSettings
from tests.test_cli_client import parsers
from tests.test_cli_worker import DEAD, config_error, pagedq
from tests.worker_proc import ROOT

DOC = Path(ROOT) / "docs" / "configuration.md"
EXAMPLE = Path(ROOT) / "docs" / "worker.example.yaml"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """Only what a test sets: no PAGEDQ_* setting (or PAGEDQ_CONFIG) from the caller."""
    for k in list(os.environ):
        if k.upper().startswith("PAGEDQ_"):
            monkeypatch.delenv(k)


def write(tmp_path: Path, text: str, name: str = "w.yaml") -> str:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return str(p)


def resolved(*argv: str):
    return resolve(build_parser().parse_args(["worker", *argv]))


def default_of(name: str) -> typing.Any:
    f = Settings.model_fields.get(name) if name in service_fields() else \
        WorkerSettings.model_fields[name]
    return list(f.default) if isinstance(f.default, tuple) else f.default


# ---- precedence: flag > env > file > default --------------------------------------------

def test_each_layer_overrides_the_ones_below(tmp_path, monkeypatch):
    f = write(tmp_path, "scheduler:\n  max_num_seqs: 8\nservice:\n  lease_s: 5\n"
                        "model:\n  enforce_eager: true\n")
    cfg = resolved()
    assert (cfg.worker.max_num_seqs, cfg.sources["max_num_seqs"]) == (64, "default")
    cfg = resolved("--config", f)
    assert (cfg.worker.max_num_seqs, cfg.sources["max_num_seqs"]) == (8, "file")
    assert (cfg.service.lease_s, cfg.worker.enforce_eager) == (5, True)
    monkeypatch.setenv("PAGEDQ_MAX_NUM_SEQS", "12")
    monkeypatch.setenv("pagedq_lease_s", "6")  # case-insensitive, as pydantic-settings reads it
    monkeypatch.setenv("PAGEDQ_ENFORCE_EAGER", "false")
    cfg = resolved("--config", f)
    assert (cfg.worker.max_num_seqs, cfg.sources["max_num_seqs"]) == (12, "env")
    assert (cfg.service.lease_s, cfg.sources["lease_s"]) == (6, "env")
    assert (cfg.worker.enforce_eager, cfg.sources["enforce_eager"]) == (False, "env")
    cfg = resolved("--config", f, "--max-num-seqs", "16", "--enforce-eager")
    assert (cfg.worker.max_num_seqs, cfg.sources["max_num_seqs"]) == (16, "flag")
    assert (cfg.worker.enforce_eager, cfg.sources["enforce_eager"]) == (True, "flag")
    assert cfg.engine_kwargs()["max_num_seqs"] == 16 and cfg.engine_kwargs()["enforce_eager"]
    # --no-<flag> is a flag value too, above a true one in the file
    monkeypatch.delenv("PAGEDQ_ENFORCE_EAGER")
    assert resolved("--config", f, "--no-enforce-eager").worker.enforce_eager is False


def test_config_file_from_flag_or_environment(tmp_path, monkeypatch):
    a = write(tmp_path, "cache:\n  block_size: 32\n", "a.yaml")
    b = write(tmp_path, "cache:\n  block_size: 64\n", "b.yaml")
    monkeypatch.setenv("PAGEDQ_CONFIG", a)
    assert (resolved().worker.block_size, resolved().file) == (32, a)
    assert resolved("--config", b).worker.block_size == 64  # the flag names the file
    monkeypatch.setenv("PAGEDQ_CONFIG", "")
    assert resolved().file is None


def test_service_values_from_every_layer_reach_settings(tmp_path, monkeypatch):
    f = write(tmp_path, "service:\n  lanes: [urgent, bulk]\n  prefix: fromfile\n"
                        "  redis_url: redis://file:1/0\nmodel:\n  path: /m/tiny-llama\n")
    cfg = resolved("--config", f)
    assert cfg.service.lanes == ("urgent", "bulk") and cfg.service.prefix == "fromfile"
    assert cfg.service.model == "tiny-llama"  # the served name derives from model.path
    monkeypatch.setenv("PAGEDQ_LANES", "a,b,c")
    monkeypatch.setenv("PAGEDQ_SERVED_NAME", "named")
    cfg = resolved("--config", f, "--prefix", "fromflag")
    assert cfg.service.lanes == ("a", "b", "c") and cfg.service.prefix == "fromflag"
    assert (cfg.service.model, cfg.worker.model) == ("named", "/m/tiny-llama")
    assert cfg.service.redis_url == "redis://file:1/0"
    # the root parser's --redis-url (before the subcommand) is a flag as well
    a = build_parser().parse_args(["--redis-url", "redis://flag:2/0", "worker", "--config", f])
    assert resolve(a).service.redis_url == "redis://flag:2/0"


def test_seed_is_random_per_process_unless_set(tmp_path):
    f = write(tmp_path, "model:\n  seed: 7\n")
    assert len({resolved().engine_kwargs()["seed"] for _ in range(3)}) == 3
    assert resolved("--config", f).engine_kwargs()["seed"] == 7


# ---- every key maps to a real setting, every setting has a key ---------------------------

def test_each_declared_choice_is_taken_from_every_layer_and_nothing_else(monkeypatch, capsys):
    """A setting's choices are declared once (wire/engine_config.py, worker/settings.py):
    the flag, the variable and the engine take each of them, and refuse anything else."""
    from pagedq.worker.cli import check_config
    from pagedq.worker.settings import DECLARED

    with_choices = [d for d in DECLARED.values() if d.setting.choices]
    assert {d.name for d in with_choices} >= {"dtype", "kv_cache_dtype", "block_size",
                                              "load_format", "scheduling_policy", "log_level"}
    for d in with_choices:
        for value in d.setting.choices:
            cfg = check_config(build_parser().parse_args(["config", flag_name(d.name),
                                                          str(value)]))
            assert cfg.value(d.name) == value, d.name
            monkeypatch.setenv(env_name(d.name), str(value))
            assert check_config(build_parser().parse_args(["config"])).value(d.name) == value
            monkeypatch.delenv(env_name(d.name))
        monkeypatch.setenv(env_name(d.name), "99" if d.base is int else "bogus")
        assert main(["config"]) == 78 and d.name in capsys.readouterr().err.lower().replace(
            "pagedq_", "").replace("-", "_"), d.name
        monkeypatch.delenv(env_name(d.name))
        bad = main(["config", flag_name(d.name), "99" if d.base is int else "bogus"])
        assert bad == (2 if d.setting.flag_choices else 78), d.name
        capsys.readouterr()


def test_sections_cover_every_setting_once():
    names = [n for keys in sections().values() for n in keys.values()]
    assert len(names) == len(set(names))
    assert set(names) == set(service_fields()) | set(WorkerSettings.model_fields)
    assert not set(service_fields()) & set(WorkerSettings.model_fields)
    assert set(sections()) == {"model", "scheduler", "cache", "service"}


def test_engine_settings_mirror_engine_config():
    from pagedq.engine.config import EngineConfig

    fields = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    assert set(ENGINE_FIELDS) == set(fields)
    for name in ENGINE_FIELDS:
        want = None if name == "seed" else fields[name]  # None: random per process
        assert WorkerSettings.model_fields[name].default == want, name


def test_every_flag_is_a_setting_of_the_same_name():
    w = next(p for p in parsers(build_parser()) if p.prog == "pagedq worker")
    dests = {a.dest for a in w._actions if a.option_strings} - {"help", "config"}
    assert dests == set(FLAGGED)
    for a in w._actions:
        if a.dest in FLAGGED:
            assert flag_name(a.dest) in a.option_strings
    helps = {a.dest: a.help for a in w._actions}
    for name in ("gpu_memory_utilization", "kv_cache_memory_gb", "max_num_seqs"):
        assert f"(default: {default_of(name)})" in helps[name], name


def _sample(name: str) -> typing.Any:
    """A valid value of a setting other than its default."""
    special = {"model": "/models/x-1", "served_name": "srv", "device": "cpu",
               "dtype": "float16", "load_format": "dummy", "kv_cache_dtype": "fp8",
               "quantization": "gptq",
               "scheduling_policy": "fcfs", "block_size": 32, "gpu_memory_utilization": 0.5,
               "redis_url": "redis://elsewhere:7000/3", "prefix": "pfx",
               "lanes": ["hi", "lo"], "metrics_host": "0.0.0.0", "log_level": "debug",
               "worker_id": "w-7"}
    if name in special:
        return special[name]
    ann, default = (Settings.model_fields.get(name) or WorkerSettings.model_fields[name]).annotation, \
        default_of(name)
    if isinstance(default, list):  # a tuple of names (lanes, prefixes)
        return ["n-one", "n-two"]
    if isinstance(default, bool):
        return not default
    if isinstance(default, int | float):
        return default + 1 if isinstance(default, int) else default + 0.25
    args = set(typing.get_args(ann))
    if default is None and args & {int}:
        return 11
    if default is None and args & {bool}:
        return True
    if default is None and args & {str, SecretStr}:
        return "x-value"
    raise AssertionError(f"no sample value for {name} ({ann}): add one to _sample")


def test_every_yaml_key_sets_its_setting(tmp_path):
    lines = []
    for sec, keys in sections().items():
        lines.append(f"{sec}:")
        lines += [f"  {key}: {json.dumps(_sample(name))}" for key, name in keys.items()]
    cfg = resolve(build_parser().parse_args(["config", "--config", write(tmp_path, "\n".join(
        lines))]))
    for name in yaml_keys():
        got = cfg.value(name)
        got = got.get_secret_value() if isinstance(got, SecretStr) else got
        got = list(got) if isinstance(got, tuple) else got
        assert (got, cfg.sources[name]) == (_sample(name), "file"), name


# ---- bad files, keys and values: one line, exit 78 --------------------------------------

@pytest.mark.parametrize("text,words", [
    ("scheduler:\n  max_seqs: 3\n", ["unknown key scheduler.max_seqs", "scheduler.max_num_seqs"]),
    ("lease_s: 3\n", ["unknown section 'lease_s'", "service.lease_s"]),
    ("cache:\n  max_num_seqs: 3\n", ["unknown key cache.max_num_seqs", "scheduler.max_num_seqs"]),
    ("service:\n  model: x\n", ["unknown key service.model", "model.path"]),
    ("model:\n  gpu_memory_utilization: lots\n", ["model.gpu_memory_utilization", "'lots'"]),
    ("model:\n  gpu_memory_utilization: 1.5\n", ["model.gpu_memory_utilization", "(0, 1]"]),
    ("scheduler:\n  max_num_seqs: 0\n", ["scheduler.max_num_seqs", ">= 1"]),
    ("scheduler:\n  max_num_batched_tokens: 8\n",
     ["scheduler.max_num_batched_tokens", "--max-num-seqs (default 64)"]),
    ("model:\n  device: gpu\n", ["model.device", "cuda:N", "'gpu'"]),
    ("service:\n  lease_s: -1\n", ["service.lease_s", "greater than 0", "-1"]),
    ("service:\n  lanes: [a, a]\n", ["service.lanes", "distinct"]),
    ("service:\n  prefix: 'a b'\n", ["service.prefix", "'a b'"]),
    ("scheduler: [1, 2]\n", ["section scheduler must be a mapping"]),
    ("- 1\n", ["top level must be a mapping"]),
    ("scheduler:\n  a: b: c\n", ["not valid YAML at line 2"]),
])
def test_bad_file_content_is_one_line_naming_file_and_key(tmp_path, capsys, text, words):
    f = write(tmp_path, text)
    assert main(["config", "--config", f]) == 78
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and err.startswith("pagedq: "), err
    for w in [f, *words]:
        assert w in err, (w, err)


def test_missing_unreadable_or_binary_file(tmp_path, capsys):
    binary = tmp_path / "b.yaml"
    binary.write_bytes(b"\xff\xfe\x00")
    for path, words in ((str(tmp_path / "nope.yaml"), "no such file"),
                        (str(tmp_path), "cannot be read"), (str(binary), "not UTF-8")):
        assert main(["config", "--config", path]) == 78
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and path in err and words in err, err


@pytest.mark.parametrize("env,words", [
    ({"PAGEDQ_ENFORCE_EAGER": "maybe"}, ["PAGEDQ_ENFORCE_EAGER", "'maybe'"]),
    ({"PAGEDQ_GPU_MEMORY_UTILIZATION": "2"}, ["PAGEDQ_GPU_MEMORY_UTILIZATION", "(0, 1]"]),
    ({"PAGEDQ_MAX_NUM_SEQS": "x"}, ["PAGEDQ_MAX_NUM_SEQS", "valid integer"]),
    ({"PAGEDQ_LOG_LEVEL": "loud"}, ["PAGEDQ_LOG_LEVEL", "'loud'"]),
])
def test_bad_environment_value_is_one_line(monkeypatch, capsys, env, words):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(["config"]) == 78
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("pagedq: "), err
    for w in words:
        assert w in err, (w, err)


def test_bad_config_in_real_processes(tmp_path):
    bad = write(tmp_path, "scheduler:\n  max_num_seqs: many\n")
    line = config_error(pagedq("worker", "--redis-url", DEAD, "--config", bad))
    assert bad in line and "scheduler.max_num_seqs" in line and "'many'" in line
    line = config_error(pagedq("worker", "--redis-url", DEAD,
                               env={"PAGEDQ_CONFIG": str(tmp_path / "gone.yaml")}))
    assert "gone.yaml" in line and "no such file" in line
    line = config_error(pagedq("config", env={"PAGEDQ_KV_CACHE_MEMORY_GB": "0"}))
    assert "PAGEDQ_KV_CACHE_MEMORY_GB" in line and "greater than 0" in line


def test_a_flag_above_a_bad_file_value_is_still_an_error_in_the_file(tmp_path, capsys):
    # the file is read whole: a bad key there is reported even if a flag sets the setting
    f = write(tmp_path, "scheduler:\n  max_num_sq: 3\n")
    assert main(["config", "--config", f, "--max-num-seqs", "4"]) == 78
    assert "scheduler.max_num_sq" in capsys.readouterr().err


# ---- pagedq config ----------------------------------------------------------------------

def test_pagedq_config_json_shows_every_setting_and_its_source(tmp_path):
    f = write(tmp_path, "scheduler:\n  max_num_seqs: 8\n  policy: fcfs\n"
                        "service:\n  redis_url: redis://u:hunter2@h:1/0\n")
    r = pagedq("config", "--config", f, "--json", "--block-size", "32",
               env={"PAGEDQ_LEASE_S": "7"})
    assert r.returncode == 0, r.stderr
    assert "hunter2" not in r.stdout
    out = json.loads(r.stdout)
    assert out["config_file"] == f and out["precedence"] == ["flag", "env", "file", "default"]
    s = out["settings"]
    assert set(s) == set(yaml_keys().values())
    assert s["scheduler.max_num_seqs"] == {"value": 8, "source": "file",
                                           "env": "PAGEDQ_MAX_NUM_SEQS", "flag": "--max-num-seqs"}
    assert (s["scheduler.policy"]["value"], s["scheduler.policy"]["env"]) == (
        "fcfs", "PAGEDQ_SCHEDULING_POLICY")
    assert (s["cache.block_size"]["value"], s["cache.block_size"]["source"]) == (32, "flag")
    assert (s["service.lease_s"]["value"], s["service.lease_s"]["source"]) == (7.0, "env")
    assert s["service.redis_url"]["value"] == "redis://u:***@h:1/0"
    assert (s["model.path"]["value"], s["model.path"]["source"]) == ("smollm2", "default")
    assert s["model.served_name"]["value"] == "smollm2"  # derived


def test_pagedq_config_never_shows_a_password(monkeypatch):
    from pagedq.worker.config_show import render

    monkeypatch.setenv("PAGEDQ_REDIS_PASSWORD", "s3cret-pw")
    cfg = resolved()
    for text in (render(cfg), render(cfg, as_json=True)):
        assert "s3cret-pw" not in text
    s = json.loads(render(cfg, as_json=True))["settings"]
    assert s["service.redis_password"] == {"value": "**********", "source": "env",
                                           "env": "PAGEDQ_REDIS_PASSWORD", "flag": None}


def test_a_bad_password_value_is_not_echoed(tmp_path, capsys):
    f = write(tmp_path, "service:\n  redis_password: [hunter2]\n")
    assert main(["config", "--config", f]) == 78
    err = capsys.readouterr().err
    assert "service.redis_password" in err and "hunter2" not in err, err


def test_pagedq_config_table_and_no_torch(tmp_path):
    f = write(tmp_path, "cache:\n  block_size: 64\n")
    code = ("import sys\nfrom pagedq.cli import main\n"
            f"rc = main(['config', '--config', {f!r}, '--max-num-seqs', '3'])\n"
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
            "assert rc == 0 and not bad, (rc, bad)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDQ_")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={**env, "PYTHONPATH": ROOT, "PAGEDQ_LEASE_S": "9"}, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = {ln.split()[0]: ln.split()[1:] for ln in r.stdout.splitlines()[2:]}
    assert r.stdout.startswith(f"# config file: {f}; precedence: flag > env > file > default")
    assert set(rows) == set(yaml_keys().values())
    assert rows["cache.block_size"] == ["64", "file", "PAGEDQ_BLOCK_SIZE"]
    assert rows["scheduler.max_num_seqs"] == ["3", "flag", "PAGEDQ_MAX_NUM_SEQS"]
    assert rows["service.lease_s"] == ["9.0", "env", "PAGEDQ_LEASE_S"]
    assert rows["model.max_model_len"] == ["null", "default", "PAGEDQ_MAX_MODEL_LEN"]


# ---- docs: every setting documented; the example file loads ----------------------------

ROW = re.compile(r"^\| `(\w+\.\w+)` \| `(PAGEDQ_\w+)` \| ([^|]*) \| `([^`]*)` \| (.+) \|$", re.M)


def test_configuration_doc_lists_every_setting_with_env_flag_and_default():
    rows = {m[1]: m for m in ROW.finditer(DOC.read_text(encoding="utf-8"))}
    keys = yaml_keys()
    missing = sorted(k for k in keys.values() if k not in rows)
    assert not missing, f"settings not documented in docs/configuration.md: {missing}"
    assert set(rows) <= set(keys.values()), "documented keys that are no setting"
    for name, key in keys.items():
        m = rows[key]
        assert m[2] == env_name(name), key
        flag = flag_name(name)
        assert (f"`{flag}`" in m[3]) if flag else m[3].strip() == "-", key
        assert m[4] == _text(default_of(name)), (key, m[4], default_of(name))


def test_example_file_lists_every_section_and_is_valid(capsys):
    import yaml

    data = yaml.safe_load(EXAMPLE.read_text(encoding="utf-8"))
    assert set(data) == set(sections())
    assert main(["config", "--config", str(EXAMPLE), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)["settings"]
    for sec, body in data.items():
        for key, value in body.items():
            got = s[f"{sec}.{key}"]
            assert got["source"] == "file" and got["value"] == value, (sec, key)


def test_a_file_without_sections_is_all_defaults(tmp_path):
    cfg = resolved("--config", write(tmp_path, "# nothing set\n"))
    assert set(cfg.sources.values()) == {"default"}
    with pytest.raises(ConfigError, match="unknown section"):
        resolved("--config", write(tmp_path, "models:\n  path: x\n"))


# ---- end to end: a worker configured by its file alone ----------------------------------

@dataclasses.dataclass
class FileWorker:
    client: Client
    worker_id: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


@pytest.fixture(scope="module")
def file_worker(tmp_path_factory, tiny_dir, shared_redis_server):
    """`pagedq worker --config FILE`, nothing else: 2 seats, 64-token context (the tiny
    model's own is 256). Steps are slowed (a failpoint) so that a job holds its seat for
    a while."""
    d = tmp_path_factory.mktemp("cfg")
    prefix, wid = f"cfg{uuid.uuid4().hex[:8]}", f"cfgw-{uuid.uuid4().hex[:6]}"
    path = d / "worker.yaml"
    path.write_text(f"model:\n  path: {tiny_dir}\n  served_name: tinycfg\n  device: cpu\n"
                    f"  max_model_len: 64\nscheduler:\n  max_num_seqs: 2\n  prefill_wait_steps: 2\n"
                    f"service:\n  redis_url: {shared_redis_server.url}\n  prefix: {prefix}\n"
                    f"  worker_id: {wid}\n  log_level: debug\n  heartbeat_ttl_s: 0.6\n",
                    encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDQ_")}
    env.update(PYTHONPATH=ROOT, PAGEDQ_FAILPOINTS="step_sleep_s=0.03")
    log_path = d / "worker.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "pagedq", "worker", "--config",
                                 str(path)], stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=ROOT)
    r = redis.Redis.from_url(shared_redis_server.url, decode_responses=True)
    deadline = time.monotonic() + 180
    while not r.exists("{" + prefix + "}:worker:" + wid):  # ready: its heartbeat exists
        assert proc.poll() is None, log_path.read_text(errors="replace")[-3000:]
        assert time.monotonic() < deadline, "worker not ready in 180 s"
        time.sleep(0.1)
    c = Client(shared_redis_server.url, prefix=prefix, model="tinycfg")
    yield FileWorker(c, wid, log_path)
    c.close()
    r.close()
    proc.terminate()
    proc.wait(30)


def test_worker_from_file_serves_and_refuses_prompts_over_its_max_model_len(file_worker):
    c = file_worker.client
    ok = c.submit("hello", max_tokens=5, temperature=0.0, ignore_eos=True)
    long = c.submit("x" * 80, max_tokens=5)  # 80 byte tokens > the file's 64
    rec = c.result(ok, timeout=120)
    assert rec.status == "finished" and rec.usage.completion_tokens == 5, rec
    rec = c.result(long, timeout=120)
    assert rec.status == "failed" and "the model's context is 64 tokens" in rec.error, rec
    # the worker logged what it took from the file
    logged = [json.loads(ln) for ln in file_worker.log_path.read_text().splitlines()
              if '"worker_config"' in ln]
    assert len(logged) == 1 and logged[0]["config_file"].endswith("worker.yaml")
    assert logged[0]["settings"]["scheduler.max_num_seqs"] == "2 (file)"
    assert logged[0]["settings"]["model.max_model_len"] == "64 (file)"
    # the engine took it (the CPU's default is 0): the ready line says so
    assert "arrivals wait <= 2 steps" in file_worker.log_path.read_text()


def test_worker_from_file_runs_at_most_its_max_num_seqs_jobs(file_worker):
    """The heartbeat's ``running`` is the number of jobs holding a seat (beats every 0.2 s
    with the file's heartbeat_ttl_s). Four jobs of >= 1 s each on 2 seats: it reads 2,
    never more (with the default 64 seats it would read 4 for a second)."""
    c, fw = file_worker.client, file_worker
    ids = [c.submit(f"job {k}", max_tokens=40, temperature=0.0, ignore_eos=True)
           for k in range(4)]
    seen, deadline = set(), time.monotonic() + 120
    while not all(c.status(j).done for j in ids):
        running = c.redis.hget(c.keys.worker(fw.worker_id), "running")
        seen.add(int(running or 0))
        assert time.monotonic() < deadline, (seen, fw.log())
        time.sleep(0.02)
    assert max(seen) == 2, seen
    for j in ids:
        assert c.result(j, timeout=120).status == "finished", fw.log()
