"""`pagedq serve MODEL`: one command that serves a model over OpenAI's API on one machine,
as ``python -m vllm.entrypoints.openai.api_server --model M`` does: Redis (``--redis-url``
/ $PAGEDQ_REDIS_URL, else an embedded redis-server), ``--workers N`` worker processes (one
per GPU, or per ``--tensor-parallel-size`` GPUs) and the gateway, then one line with the URL
to point an OpenAI client at.

Every child runs in its own session, so a terminal's Ctrl-C reaches this process alone; it
then sends each child one SIGTERM: the workers stop intake and finish their running jobs
(for at most PAGEDQ_DRAIN_TIMEOUT_S, then hand the rest back), the gateway finishes its open
requests, and the embedded Redis stops last. A second Ctrl-C stops everything at once. Each
child also gets SIGTERM when this process dies, even by SIGKILL (Linux: PR_SET_PDEATHSIG),
so nothing outlives it. With the embedded Redis, jobs still queued at the stop are gone with
it; with ``--redis-url`` they stay queued for the next worker.

Exit codes of ``pagedq serve``:

   0  clean stop after Ctrl-C/SIGTERM: every child stopped as asked
   1  a child exited on its own (a worker or the gateway failed: the line says which, its
      own output is above it), or did not stop cleanly
   2  command-line usage error
  78  bad configuration: one line "pagedq: ..." (a worker option, the model, the gateway's
      address or port, --workers for the GPUs there are)
 130  a second Ctrl-C: everything was stopped at once
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable

from pagedq.worker.config import ConfigError, flag_argv
from pagedq.worker.redis_server import RedisServer, die_with_parent

EXIT_CODES_HELP = "exit codes:\n" + __doc__.split("Exit codes of ``pagedq serve``:\n\n", 1)[1]
STOP_WAIT_S = 35.0  # beyond the workers' drain: the gateway's graceful shutdown is 30 s
POLL_S = 0.2  # how often the children are looked at
READY_POLL_S = 1.0  # until ready: Redis, then the gateway's /health (one access-log line)


def register(sub: argparse._SubParsersAction, parents: Iterable[argparse.ArgumentParser]) -> None:
    """Add `pagedq serve`: the options of `pagedq worker`, vLLM's names of them, and the
    gateway's address."""
    from pagedq.worker.cli import add_worker_args

    s = sub.add_parser("serve", help="Redis + worker(s) + gateway in one command: OpenAI's "
                                     "API for one model on this machine",
                       description="Serve MODEL over OpenAI's HTTP API on this machine: Redis "
                                   "(--redis-url or $PAGEDQ_REDIS_URL, else an embedded "
                                   "redis-server), --workers "
                                   "worker processes and the gateway; Ctrl-C stops them all "
                                   "(docs/gateway.md \"pagedq serve\"). Every `pagedq worker` "
                                   "option applies to each worker.",
                       parents=list(parents), epilog=EXIT_CODES_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("model_arg", nargs="?", metavar="MODEL",
                   help="the model, as --model takes it (default: --model, else smollm2)")
    add_worker_args(s)
    s.add_argument("--served-model-name", dest="served_name", default=None, metavar="NAME",
                   help="vLLM's name of --served-name (default: the model's name)")
    s.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vLLM's command lines; no effect: pagedq never runs a "
                        "checkpoint's own code (default: off)")
    s.add_argument("--workers", type=int, default=1, metavar="N",
                   help="worker processes; on GPUs one per --tensor-parallel-size devices, "
                        "from --device cuda:K on (default: %(default)s)")
    s.add_argument("--host", default=None,
                   help="the gateway's address; 0.0.0.0 = every interface (default: "
                        "$PAGEDQ_GATEWAY_HOST or 127.0.0.1)")
    s.add_argument("--port", type=int, default=None,
                   help="the gateway's TCP port (default: $PAGEDQ_GATEWAY_PORT or 8000)")
    s.set_defaults(func=cmd_serve)


def worker_devices(device: str, workers: int, tp: int, gpus: int | None = None) -> list[str]:
    """The ``--device`` of each worker: on CUDA, worker k takes ``tp`` GPUs from
    ``cuda:base+k*tp`` (ConfigError when there are too few); ``gpus``: the GPU count
    (None: ask torch, only when more than one worker needs a GPU of its own)."""
    if workers < 1:
        raise ConfigError(f"--workers {workers}: must be >= 1")
    m = re.fullmatch(r"cuda(?::(\d+))?", device)
    if workers == 1 or device == "cpu" or not (m or device == "auto"):
        return [device] * workers
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count()
    if device == "auto" and gpus == 0:
        return ["cpu"] * workers
    base = int(m[1]) if m and m[1] else 0
    if base + workers * tp > gpus:
        raise ConfigError(f"--workers {workers} with --tensor-parallel-size {tp} needs "
                          f"{workers * tp} GPUs from cuda:{base} on; this machine has {gpus}")
    return [f"cuda:{base + k * tp}" for k in range(workers)]


class Served:
    """The child processes of one `pagedq serve`, started and stopped together."""

    def __init__(self) -> None:
        self.redis: RedisServer | None = None
        self.children: list[tuple[str, subprocess.Popen]] = []  # (name, process)

    def start_redis(self, url: str | None) -> str:
        if url:
            return url
        self.redis = RedisServer(die_with_parent=True).start()
        return self.redis.url

    def spawn(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        """``python -m pagedq ARGV`` in a session of its own (the terminal's Ctrl-C is
        ours to pass on), dying with us; its output goes to our stderr (our stdout carries
        our own lines alone: the URL)."""
        proc = subprocess.Popen([sys.executable, "-m", "pagedq", *argv], stdin=subprocess.DEVNULL,
                                stdout=sys.stderr, env={**os.environ, **env},
                                start_new_session=True, preexec_fn=die_with_parent)
        self.children.append((name, proc))

    def exited(self) -> tuple[str, int] | None:
        """(name, exit code) of a child that has ended, or None."""
        for name, p in self.children:
            if p.poll() is not None:
                return name, p.returncode
        return None

    def signal_all(self, sig: int) -> None:
        for _, p in self.children:
            if p.poll() is None:
                p.send_signal(sig)

    def wait_all(self, timeout: float) -> bool:
        """Whether every child ended within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        for _, p in self.children:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False
        return True

    def kill_all(self) -> None:
        self.signal_all(signal.SIGKILL)
        for _, p in self.children:
            p.wait()

    def close(self) -> None:
        """Every child gone (killed if still there), then the embedded Redis."""
        if any(p.poll() is None for _, p in self.children):
            self.kill_all()
        if self.redis is not None:
            self.redis.cleanup()


class _Stop:
    """SIGINT/SIGTERM: the first asks for a clean stop, the next for an immediate one."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, signum: int, _frame: object) -> None:
        self.count += 1


def cmd_serve(args: argparse.Namespace) -> int:
    from pagedq.worker.cli import check_config, check_model

    if args.model_arg is not None:
        if args.model is not None and args.model != args.model_arg:
            raise ConfigError(f"the model is given twice: {args.model_arg!r} and --model "
                              f"{args.model!r}")
        args.model = args.model_arg
    if args.trust_remote_code:
        print("pagedq: --trust-remote-code has no effect: pagedq never runs a checkpoint's "
              "own code", file=sys.stderr)
    cfg = check_config(args)
    check_model(cfg)
    host, port = _gateway_address(args)
    devices = worker_devices(cfg.worker.device, args.workers, cfg.worker.tensor_parallel_size)
    stop = _Stop()
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    served = Served()
    try:
        return _serve(args, cfg, served, devices, host, port, stop)
    finally:
        served.close()


def _gateway_address(args: argparse.Namespace) -> tuple[str, int]:
    """The gateway's host and port (flags > PAGEDQ_GATEWAY_* > defaults), bindable now."""
    from pydantic import ValidationError

    from pagedq.gateway.settings import GatewaySettings

    try:
        g = GatewaySettings(**{k: v for k, v in (("host", args.host), ("port", args.port))
                               if v is not None})
    except ValidationError as e:
        err = e.errors()[0]
        raise ConfigError(f"--{err['loc'][0]}: {err['msg']} (got {err.get('input')!r})") from None
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"the gateway needs FastAPI and uvicorn ({e}): pip install "
                          "'pagedq[gateway]'") from None
    try:
        with socket.create_server((g.host, g.port)):
            pass
    except (OSError, OverflowError) as e:
        raise ConfigError(f"--host {g.host} --port {g.port} cannot be bound: {e}") from None
    return g.host, g.port


def _serve(args, cfg, served: Served, devices: list[str], host: str, port: int,
           stop: _Stop) -> int:
    from pagedq.wire.redis_errors import redact_url

    url = served.start_redis(args.redis_url or os.environ.get("PAGEDQ_REDIS_URL"))
    env = {"PAGEDQ_REDIS_URL": url}  # by the environment: a password in it stays out of ps
    if args.prefix:
        env["PAGEDQ_PREFIX"] = args.prefix
    model = cfg.service.model  # the served name: the streams' and the API's model
    skip = frozenset({"redis_url", "prefix", "device", "worker_id", "metrics_port", "model"})
    common = ["worker", "--model", cfg.worker.model,
              *(["--config", args.config] if args.config else []), *flag_argv(args, skip)]
    for k, device in enumerate(devices):
        argv = [*common, "--device", device]
        if args.worker_id:
            argv += ["--worker-id", args.worker_id + (f"-{k}" if len(devices) > 1 else "")]
        if args.metrics_port:  # worker k: the port + k
            argv += ["--metrics-port", str(args.metrics_port + k)]
        served.spawn(f"worker {k} ({device})", argv, env)
    served.spawn("gateway", ["gateway", "--host", host, "--port", str(port), "--model", model,
                             *(["--log-level", args.log_level] if args.log_level else [])],
                 env)
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    base_url = f"http://{shown}:{port}/v1"
    print(f"pagedq serve: loading {cfg.worker.model} in {len(devices)} worker(s) on "
          f"{', '.join(devices)}; Redis {redact_url(url)}"
          + (" (embedded)" if served.redis else ""), file=sys.stderr, flush=True)
    ready, next_check = False, 0.0
    while not stop.count:
        gone = served.exited()
        if gone is not None:
            print(f"pagedq: serve: the {gone[0]} exited with code {gone[1]}; stopping the "
                  f"others", file=sys.stderr, flush=True)
            served.signal_all(signal.SIGTERM)
            served.wait_all(STOP_WAIT_S)
            return 1
        if not ready and time.monotonic() >= next_check:
            next_check = time.monotonic() + READY_POLL_S
            ready = _ready(url, args.prefix, model, base_url)
            if ready:
                print(f"pagedq serve: {model} is served at {base_url} (OpenAI base_url, "
                      f"model {model!r}); Ctrl-C stops", flush=True)
        time.sleep(POLL_S)
    return _stop(served, stop, cfg.service.drain_timeout_s)


def _stop(served: Served, stop: _Stop, drain_s: float) -> int:
    """One SIGTERM to each child, then wait: the workers drain, the gateway finishes its
    open requests. A second Ctrl-C meanwhile: everything is killed now (130)."""
    print("pagedq serve: stopping: running jobs finish (at most "
          f"{drain_s:g} s), open requests end; Ctrl-C again to stop at once",
          file=sys.stderr, flush=True)
    served.signal_all(signal.SIGTERM)
    deadline = time.monotonic() + drain_s + STOP_WAIT_S
    while time.monotonic() < deadline and stop.count < 2:
        if served.wait_all(POLL_S):
            break
    if stop.count >= 2 or any(p.poll() is None for _, p in served.children):
        served.kill_all()
        return 130 if stop.count >= 2 else 1
    bad = [(n, p.returncode) for n, p in served.children
           if p.returncode not in (0, -signal.SIGTERM)]
    for name, code in bad:
        print(f"pagedq: serve: the {name} ended with code {code}", file=sys.stderr)
    return 1 if bad else 0


def _ready(url: str, prefix: str | None, model: str, base_url: str) -> bool:
    """A worker serves the model (its heartbeat is in Redis) and the gateway answers."""
    import urllib.request

    import redis

    from pagedq.producer import Client
    from pagedq.wire.settings import Settings

    try:
        settings = Settings(redis_url=url, **({"prefix": prefix} if prefix else {}))
        with Client(settings=settings) as c:
            if model not in c.served_models():
                return False
    except redis.RedisError:
        return False
    try:
        with urllib.request.urlopen(base_url.removesuffix("/v1") + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False
