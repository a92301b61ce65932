"""The `pagedq` console script: worker and demo here, client commands from producer.cli.
Heavy imports (torch, the engine) happen only inside the worker/demo commands.

``--redis-url`` and ``--prefix`` are accepted before or after the subcommand; given in
both places, the one after the subcommand wins.

Exit codes of ``pagedq worker``:

   0  clean stop after SIGTERM/SIGINT: intake stopped, running jobs drained
      (for at most PAGEDQ_DRAIN_TIMEOUT_S)
   2  command-line usage error (unknown option, not a number, not one of the choices)
  70  a wedged engine step: the step watchdog (PAGEDQ_STEP_WATCHDOG_S) fired
  71  an unexpected error in any worker thread
  78  bad configuration (EX_CONFIG): one line "pagedq: ..." on stderr says what was
      wrong and what is allowed (an engine option, the model path, --device, a
      PAGEDQ_* setting, the Redis URL)
 128+N  killed by a second signal N while draining (130: Ctrl-C, 143: SIGTERM);
      130 also for Ctrl-C while the model loads

The client commands' exit codes are listed in producer/cli.py (and in ``pagedq -h``).
"""
from __future__ import annotations

import argparse
import os
import re
import secrets
import signal
import sys

from producer import cli as client_cli
from worker import fatal
from worker.names import served_name

EXIT_CLEAN = 0
# 70: the step watchdog (worker/liveness.py); 71: an unexpected error in a worker thread;
# 78: bad configuration. One definition, in worker/fatal.py (no torch import there).
EXIT_WEDGED, EXIT_THREAD_ERROR, EXIT_CONFIG = fatal.EXIT_WEDGED, fatal.EXIT_FAULT, fatal.EXIT_CONFIG

WORKER_EXIT_CODES_HELP = "exit codes of `pagedq worker`:\n" + __doc__.split(
    "Exit codes of ``pagedq worker``:\n\n", 1)[1].split("\nThe client commands'", 1)[0]

# Engine options -> EngineConfig field names (their defaults live in engine/config.py,
# not imported here: building the parser must not import the engine; a test checks them).
ENGINE_INT_OPTIONS = ("max_num_seqs", "max_num_batched_tokens", "max_model_len",
                      "num_kv_blocks", "block_size")
DEVICE_RE = re.compile(r"auto|cpu|cuda(:\d+)?")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


class ConfigError(Exception):
    """A setting that parsed but is not allowed: exit EXIT_CONFIG with one line."""


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(
        prog="pagedq", description="Queue-fed LLM generation over Redis.",
        parents=[client_cli.common_options(after_subcommand=False)],
        epilog=client_cli.EXIT_CODES_HELP + "\n" + WORKER_EXIT_CODES_HELP, formatter_class=fmt)
    client_cli.add_version(p)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    after = [client_cli.common_options(after_subcommand=True)]

    w = sub.add_parser("worker", help="serve generation jobs from the model's jobs stream",
                       description="Serve generation jobs from the model's jobs stream.",
                       parents=after, epilog=WORKER_EXIT_CODES_HELP, formatter_class=fmt)
    add_engine_args(w)
    w.add_argument("--worker-id", default=None,
                   help="stable consumer name; a restarted worker with the same id re-reads "
                        "its own pending jobs (default: <hostname>-<pid>)")
    w.add_argument("--log-level", default="info", choices=LOG_LEVELS, type=str.lower,
                   help="log level of the JSON logs on stderr (default: %(default)s)")
    w.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus metrics on this port "
                        "(default: $PAGEDQ_METRICS_PORT or 0 = off)")
    w.add_argument("--metrics-host", default=None, metavar="HOST",
                   help="address the metrics endpoint listens on; 0.0.0.0 = every interface "
                        "(default: $PAGEDQ_METRICS_HOST or 127.0.0.1)")
    w.add_argument("--lanes", default=None, metavar="A,B,...",
                   help="the lanes (jobs streams) to serve, highest first "
                        "(default: $PAGEDQ_LANES or interactive,batch)")
    w.add_argument("--lane-min-share", type=float, default=None, metavar="F",
                   help="seats each lower lane keeps while it has work, as a share of "
                        "--max-num-seqs (default: $PAGEDQ_LANE_MIN_SHARE or 0.1)")
    w.set_defaults(func=cmd_worker)

    d = sub.add_parser("demo", help="embedded Redis + CPU worker + a few streamed jobs",
                       description="Embedded Redis + CPU worker + a few streamed jobs.",
                       parents=after)
    add_engine_args(d)
    d.add_argument("--jobs", type=int, default=6, help="jobs to submit (default: %(default)s)")
    d.add_argument("--max-tokens", type=int, default=48,
                   help="max_tokens of each job (default: %(default)s)")
    d.set_defaults(func=cmd_demo)

    client_cli.register(sub, parents=after)
    return p


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="'smollm2' (bundled), a local HF folder, or a .gguf file "
                        "(default: $PAGEDQ_MODEL or smollm2)")
    p.add_argument("--served-name", default=None,
                   help="jobs stream name for this model (default: the --model value if it "
                        "is a name, else the folder/file stem)")
    p.add_argument("--device", default="auto",
                   help="auto, cpu, cuda or cuda:N (default: %(default)s = cuda if available, "
                        "else cpu)")
    p.add_argument("--dtype", default="auto",
                   help="auto, float32, bfloat16 or float16 (default: %(default)s = bfloat16 "
                        "on CUDA, float32 on CPU)")
    p.add_argument("--max-num-seqs", type=int, default=None, metavar="N",
                   help="sequences in one engine step (default: 64)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                   help="token budget of one engine step, >= --max-num-seqs (default: 2048)")
    p.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="longest sequence, prompt + output (default: the model's context "
                        "length, lowered to what the KV cache holds)")
    p.add_argument("--num-kv-blocks", type=int, default=None, metavar="N",
                   help="KV-cache blocks (default: sized from memory)")
    p.add_argument("--block-size", type=int, default=None, metavar="N",
                   help="tokens per KV block: 8, 16, 32, 64 or 128 (default: 16)")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights from config.json alone, for benchmarks "
                        "(default: %(default)s)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="fp8: float8_e4m3 KV cache, twice the tokens per GiB (accuracy: "
                        "docs/benchmarks.md) (default: %(default)s = the model dtype)")
    p.add_argument("--scheduling-policy", default="priority", choices=["priority", "fcfs"],
                   help="priority: higher lanes and priorities go first and may preempt "
                        "lower ones; fcfs: arrival order (default: %(default)s)")
    p.add_argument("--seed", type=int, default=None,
                   help="noise seed of jobs without their own seed (default: random per process, "
                        "so workers never share a noise stream)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    kw = {"device": args.device, "dtype": args.dtype, "load_format": args.load_format,
          "kv_cache_dtype": args.kv_cache_dtype,
          "scheduling_policy": getattr(args, "scheduling_policy", "priority"),
          "seed": args.seed if args.seed is not None else secrets.randbits(63)}
    for name in ENGINE_INT_OPTIONS:
        v = getattr(args, name)
        if v is not None:
            kw[name] = v
    return kw


def settings_from(args: argparse.Namespace):
    from producer.settings import Settings

    over = {}
    if getattr(args, "redis_url", None):
        over["redis_url"] = args.redis_url
    if getattr(args, "prefix", None):
        over["prefix"] = args.prefix
    if getattr(args, "metrics_port", None) is not None:
        over["metrics_port"] = args.metrics_port
    if getattr(args, "metrics_host", None):
        over["metrics_host"] = args.metrics_host
    if getattr(args, "lanes", None):
        over["lanes"] = args.lanes
    if getattr(args, "lane_min_share", None) is not None:
        over["lane_min_share"] = args.lane_min_share
    if getattr(args, "model", None):
        over["model"] = served_name(args.model, getattr(args, "served_name", None))
    elif getattr(args, "served_name", None):
        over["model"] = args.served_name
    return Settings(**over)


# ---- configuration checks: one clear line and EXIT_CONFIG, never a traceback ----------

def _flags(msg: str) -> str:
    """An engine message in the CLI's words: field names -> their flags, one line."""
    for name in (*ENGINE_INT_OPTIONS, "kv_cache_dtype", "load_format", "dtype", "device"):
        msg = re.sub(rf"(?<![\w-]){name}\b", "--" + name.replace("_", "-"), msg)
    return " ".join(msg.split())


def _settings_error(e) -> ConfigError:
    """A pydantic ValidationError of Settings -> which flag/variable, what is allowed."""
    parts = []
    for err in e.errors():
        name = str(err["loc"][0]) if err.get("loc") else "?"
        where = f"PAGEDQ_{name.upper()}"
        if name in ("redis_url", "prefix", "metrics_port", "metrics_host", "model", "lanes",
                    "lane_min_share"):
            where = f"--{name.replace('_', '-')} / {where}"
        parts.append(f"{where}: {err['msg']} (got {err.get('input')!r})")
    return ConfigError("bad setting: " + "; ".join(parts))


def check_settings(args: argparse.Namespace):
    """Settings and engine options that can be checked without loading torch."""
    from pydantic import ValidationError

    try:
        settings = settings_from(args)
    except ValidationError as e:
        raise _settings_error(e) from None
    from producer.keys import check_name

    for kind, value, where in (("prefix", settings.prefix, "--prefix / PAGEDQ_PREFIX"),
                               ("served model name", settings.model,
                                "--served-name (or the --model stem) / PAGEDQ_MODEL")):
        try:
            check_name(kind, value)
        except ValueError as e:
            raise ConfigError(f"{where}: {e}") from None
    try:
        import redis

        redis.ConnectionPool.from_url(settings.redis_url)  # parses only, connects later
    except ValueError as e:
        raise ConfigError(f"--redis-url / PAGEDQ_REDIS_URL {settings.redis_url!r}: "
                          f"{_flags(str(e))}") from None
    if settings.metrics_port:
        import socket

        try:
            socket.getaddrinfo(settings.metrics_host, settings.metrics_port)
        except (OSError, UnicodeError) as e:
            raise ConfigError(f"--metrics-host / PAGEDQ_METRICS_HOST {settings.metrics_host!r}"
                              f" is not an address of this host ({e}); give an IP address "
                              f"such as 127.0.0.1 or 0.0.0.0") from None
    if not DEVICE_RE.fullmatch(args.device):
        raise ConfigError(f"--device {args.device!r} is not a device: give auto, cpu, cuda "
                          f"or cuda:N")
    from engine.config import EngineConfig  # dataclasses only: no torch

    try:
        EngineConfig(**engine_kwargs(args)).validate()
    except ValueError as e:
        raise ConfigError(_flags(str(e))) from None
    return settings


def build_engine(args: argparse.Namespace):
    """LLMEngine(...) with the configuration errors it can raise as ConfigError."""
    import torch

    from engine.llm_engine import LLMEngine

    m = re.fullmatch(r"cuda(?::(\d+))?", args.device)
    if m and not torch.cuda.is_available():
        raise ConfigError(f"--device {args.device}: CUDA is not available on this machine; "
                          f"use --device cpu (or auto)")
    if m and m[1] and int(m[1]) >= torch.cuda.device_count():
        raise ConfigError(f"--device {args.device}: this machine has "
                          f"{torch.cuda.device_count()} CUDA device(s), cuda:0 to "
                          f"cuda:{torch.cuda.device_count() - 1}")
    try:
        return LLMEngine(args.model or "smollm2", **engine_kwargs(args))
    except ValueError as e:  # model path, device, max_model_len vs memory, ...
        raise ConfigError(_flags(str(e))) from None
    except OSError as e:  # an unreadable model file or folder
        raise ConfigError(f"--model {args.model or 'smollm2'!r} cannot be read: "
                          f"{' '.join(str(e).split())}") from None


def cmd_worker(args: argparse.Namespace) -> int:
    from worker import logs

    logs.configure(args.log_level)
    settings = check_settings(args)
    engine = build_engine(args)
    from worker.service import Worker

    w = Worker(engine, settings, worker_id=args.worker_id)
    install_signal_handlers(w)
    w.run()
    return EXIT_CLEAN


def install_signal_handlers(w) -> None:
    """First SIGTERM/SIGINT: stop intake and drain; a second one exits at once."""

    def handler(signum, _frame):
        if getattr(w, "_stopping", False):
            os._exit(128 + signum)
        w.request_stop()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def cmd_demo(args: argparse.Namespace) -> int:
    from worker.demo import run_demo

    check_settings(args)  # the demo's worker would exit 78 into its log file; say it here
    return run_demo(args)


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse: usage error (2), --help/--version (0)
        return 0 if e.code is None else e.code if isinstance(e.code, int) else 2
    try:
        return args.func(args) or 0
    except ConfigError as e:
        print(f"pagedq: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
