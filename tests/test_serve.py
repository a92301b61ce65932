"""`pagedq serve` (pagedq/serve.py): the bundled SmolLM2 on the CPU behind the gateway,
answered through the official openai SDK, then Ctrl-C as a terminal sends it (SIGINT to the
foreground process group): a stream in flight ends with its finish reason, the command
exits 0, and no process of its tree is left (found by an environment marker that every
descendant inherits, not only by the children it knew of). The rest is cheap: vLLM's flags
parse and check, devices per worker, bad values as one line."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from pagedq.cli import build_parser, main
from pagedq.serve import worker_devices
from pagedq.worker.cli import check_config
from pagedq.worker.config import ConfigError
from pagedq.worker.redis_server import free_port

ROOT = Path(__file__).resolve().parent.parent
VLLM_FLAGS = ["--tensor-parallel-size", "1", "--dtype", "half", "--max-num-seqs", "256",
              "--max-model-len", "4096", "--gpu-memory-utilization", "0.9"]


def marked(marker: str) -> list[psutil.Process]:
    """Every live process whose environment carries ``marker`` (zombies count as gone)."""
    out = []
    for p in psutil.process_iter():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and \
                    p.environ().get("PAGEDQ_TEST_SERVE") == marker:
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


def test_serve_answers_the_openai_sdk_and_ctrl_c_leaves_no_process(tmp_path):
    from openai import OpenAI

    port, marker = free_port(), uuid.uuid4().hex
    err = open(tmp_path / "serve.log", "w+")
    cmd = [sys.executable, "-m", "pagedq", "serve", "smollm2", "--device", "cpu", "--port",
           str(port), "--max-num-seqs", "4", "--max-model-len", "2048",
           "--tensor-parallel-size", "1", "--log-level", "warning"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PAGEDQ_TEST_SERVE": marker}
    env.pop("PAGEDQ_REDIS_URL", None)  # the embedded Redis
    # a session of its own: its process group is the terminal's foreground group
    tree: list[psutil.Process] = []
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True,
                            env=env, start_new_session=True)
    try:
        line = proc.stdout.readline()  # the one line on stdout, once it serves
        err.seek(0)
        assert line.startswith("pagedq serve: smollm2 is served at "), (line, err.read()[-3000:])
        base_url = f"http://127.0.0.1:{port}/v1"
        assert base_url in line
        tree += psutil.Process(proc.pid).children(recursive=True)
        names = sorted(p.name() for p in tree)
        assert "redis-server" in names and len(tree) == 3, names  # Redis, worker, gateway
        # redis-server writes its process title over its environment: it is found by pid
        assert {p.pid for p in marked(marker)} == {
            proc.pid, *(p.pid for p in tree if p.name() != "redis-server")}

        client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list()] == ["smollm2"]
        r = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content":
                                        "What is the capital of France?"}],
            max_tokens=12, temperature=0)
        assert "Paris" in r.choices[0].message.content
        stream = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Count to twenty."}],
            max_tokens=40, temperature=0, stream=True, stream_options={"include_usage": True})
        chunks = iter(stream)
        next(chunks)  # the stream is open: its job is running
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
        rest = list(chunks)  # the worker drains: the running job finishes
        reasons = [c.choices[0].finish_reason for c in rest if c.choices]
        assert reasons[-1] == "length" and rest[-1].usage.completion_tokens == 40
        assert proc.wait(90) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    def left() -> list[psutil.Process]:
        alive = [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        return alive + [p for p in marked(marker) if p not in alive]

    deadline = time.monotonic() + 10  # orphans would have been re-parented by now
    while left() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left(), [(p.pid, p.cmdline()) for p in left()]
    err.seek(0)
    log = err.read()
    assert "stopping: running jobs finish" in log and "Traceback" not in log, log[-3000:]


def test_vllm_flags_parse_and_pass_the_worker_checks():
    args = build_parser().parse_args(["serve", "--model", "smollm2", *VLLM_FLAGS, "--port",
                                      "8000", "--served-model-name", "chat"])
    cfg = check_config(args)
    w = cfg.worker
    assert (w.tensor_parallel_size, w.dtype, w.max_num_seqs, w.max_model_len,
            w.gpu_memory_utilization) == (1, "half", 256, 4096, 0.9)
    assert cfg.service.model == "chat" and args.port == 8000
    pos = build_parser().parse_args(["serve", "--host", "0.0.0.0", "smollm2", "--workers", "2"])
    assert (pos.model_arg, pos.host, pos.workers) == ("smollm2", "0.0.0.0", 2)


def test_one_worker_per_gpu_group():
    assert worker_devices("cuda", 4, 2, gpus=8) == ["cuda:0", "cuda:2", "cuda:4", "cuda:6"]
    assert worker_devices("cuda:2", 2, 1, gpus=4) == ["cuda:2", "cuda:3"]
    assert worker_devices("auto", 2, 1, gpus=0) == ["cpu", "cpu"]
    assert worker_devices("cpu", 3, 1) == ["cpu"] * 3
    assert worker_devices("auto", 1, 4) == ["auto"]  # one worker: the worker's own choice
    with pytest.raises(ConfigError, match="needs 6 GPUs from cuda:0 on; this machine has 4"):
        worker_devices("cuda", 3, 2, gpus=4)
    with pytest.raises(ConfigError, match="--workers 0"):
        worker_devices("cpu", 0, 1)


@pytest.mark.parametrize("argv, says", [
    (["--workers", "0"], "--workers 0: must be >= 1"),
    (["nope"], "unknown model 'nope'"),
    (["smollm2", "--model", "other"], "the model is given twice"),
    (["--port", "70000"], "--port: Input should be less than or equal to 65535"),
    (["--dtype", "float8"], "dtype must be one of"),
])
def test_bad_values_are_one_line_and_exit_78(argv, says, capsys):
    assert main(["serve", *argv]) == 78
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1 and err.startswith("pagedq: "), err


def test_a_port_in_use_is_one_line(capsys):
    import socket

    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
        assert main(["serve", "smollm2", "--port", str(port)]) == 78
    err = capsys.readouterr().err
    assert f"--port {port} cannot be bound" in err and err.count("\n") == 1, err


def test_children_die_with_a_killed_parent():
    """die_with_parent (every child of `pagedq serve`, its embedded Redis too): SIGKILL of
    the parent still ends them."""
    code = ("import subprocess, sys, time\n"
            "from pagedq.worker.redis_server import die_with_parent\n"
            "p = subprocess.Popen(['sleep', '300'], preexec_fn=die_with_parent)\n"
            "print(p.pid, flush=True)\n"
            "time.sleep(300)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    child = psutil.Process(int(parent.stdout.readline()))
    parent.kill()
    parent.wait()
    try:
        child.wait(10)
    except psutil.TimeoutExpired:
        child.kill()
        pytest.fail("the child outlived its killed parent")


def test_two_workers_on_a_given_redis_with_their_own_metrics_ports(redis_server, tiny_dir,
                                                                     tmp_path):
    """--redis-url: no embedded Redis; --workers 2: two workers of the model, worker k on
    --metrics-port + k; SIGTERM stops them (exit 0) and leaves the Redis running."""
    import urllib.request

    from pagedq.producer import Client
    from pagedq.wire.settings import Settings

    port, metrics = free_port(), free_port()
    err = open(tmp_path / "serve.log", "w+")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PAGEDQ_REDIS_URL", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedq", "serve", tiny_dir, "--served-model-name", "tiny",
         "--redis-url", redis_server.url, "--prefix", "two", "--workers", "2", "--device",
         "cpu", "--port", str(port), "--metrics-port", str(metrics), "--log-level", "warning"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True, env=env,
        start_new_session=True)
    try:
        line = proc.stdout.readline()
        err.seek(0)
        assert "tiny is served at" in line, err.read()[-3000:]
        kids = psutil.Process(proc.pid).children(recursive=True)
        names = sorted(p.name() for p in kids)
        assert "redis-server" not in names and len(names) == 3, names  # 2 workers, gateway
        with Client(settings=Settings(redis_url=redis_server.url, prefix="two")) as c:
            deadline = time.monotonic() + 60
            while c.served_models().get("tiny") != 2 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert c.served_models() == {"tiny": 2}
        for k in (0, 1):
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics + k}/healthz",
                                        timeout=5) as r:
                assert r.status == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0
        gone, alive = psutil.wait_procs(kids, timeout=10)
        assert not alive, alive
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert redis_server.ping()  # not ours to stop
