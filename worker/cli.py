"""The `pagedq` console script: worker and demo here, client commands from pagedq.producer.cli.
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
      PAGEDQ_* setting, the Redis URL, the --config file or one of its keys)
 128+N  killed by a second signal N while draining (130: Ctrl-C, 143: SIGTERM);
      130 also for Ctrl-C while the model loads

The client commands' exit codes are listed in producer/cli.py (and in ``pagedq -h``).
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import sys

from pagedq.producer import cli as client_cli
from pagedq.worker import fatal
from pagedq.worker.config import ConfigError, Resolved, resolve
from pagedq.worker.settings import LOG_LEVELS

EXIT_CLEAN = 0
# 70: the step watchdog (worker/liveness.py); 71: an unexpected error in a worker thread;
# 78: bad configuration. One definition, in worker/fatal.py (no torch import there).
EXIT_WEDGED, EXIT_THREAD_ERROR, EXIT_CONFIG = fatal.EXIT_WEDGED, fatal.EXIT_FAULT, fatal.EXIT_CONFIG

WORKER_EXIT_CODES_HELP = "exit codes of `pagedq worker`:\n" + __doc__.split(
    "Exit codes of ``pagedq worker``:\n\n", 1)[1].split("\nThe client commands'", 1)[0]

# Engine options -> EngineConfig field names (their defaults live in engine/config.py,
# not imported here: building the parser must not import the engine; a test checks them).
# Every option defaults to None = not given, so that the environment and the config file
# (worker/config.py) apply underneath it.
ENGINE_INT_OPTIONS = ("max_num_seqs", "max_num_batched_tokens", "max_model_len",
                      "num_kv_blocks", "block_size", "prefill_wait_steps")


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
                       description="Serve generation jobs from the model's jobs stream. Each "
                                   "setting: flag > PAGEDQ_<NAME> > --config file > default "
                                   "(docs/configuration.md).",
                       parents=after, epilog=WORKER_EXIT_CODES_HELP, formatter_class=fmt)
    add_worker_args(w)
    w.set_defaults(func=cmd_worker)

    c = sub.add_parser("config", help="print the worker's effective configuration and where "
                                      "each value comes from",
                       description="Print every worker setting (service and engine) as `pagedq "
                                   "worker` with the same options would use it, and its source: "
                                   "flag, env, file or default. Exit 78 if it is not valid.",
                       parents=after, formatter_class=fmt)
    add_worker_args(c)
    c.add_argument("--json", action="store_true",
                   help="print one JSON object instead of a table (default: off)")
    c.set_defaults(func=cmd_config)

    d = sub.add_parser("demo", help="embedded Redis + CPU worker + a few streamed jobs",
                       description="Redis (an embedded redis-server when none answers at "
                                   "--redis-url) + a worker with the bundled SmolLM2 + a few "
                                   "chat jobs, streamed into a live view, then a summary. The "
                                   "demo's Redis keys are removed at exit.",
                       parents=after)
    add_engine_args(d)
    d.add_argument("--jobs", type=int, default=6, help="jobs to submit (default: %(default)s)")
    d.add_argument("--max-tokens", type=int, default=48,
                   help="max_tokens of each job (default: %(default)s)")
    d.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="sampling temperature of each job (default: %(default)s = greedy)")
    d.add_argument("--plain", action="store_true",
                   help="plain lines for logs and CI instead of the live view (default: off; "
                        "on when stdout is not a terminal)")
    d.add_argument("--keep", action="store_true",
                   help="keep the demo's Redis keys and the worker's log (default: off)")
    d.set_defaults(func=cmd_demo)

    client_cli.register(sub, parents=after)
    from pagedq.gateway.cli import register as register_gateway  # no web framework imported here

    register_gateway(sub, parents=after)
    return p


def add_worker_args(w: argparse.ArgumentParser) -> None:
    """The options of `pagedq worker` (and of `pagedq config`, which shows their effect)."""
    w.add_argument("--config", default=None, metavar="FILE",
                   help="YAML file of settings, sections model/scheduler/cache/service; flags "
                        "and PAGEDQ_* variables override it (default: $PAGEDQ_CONFIG or none)")
    add_engine_args(w)
    w.add_argument("--worker-id", default=None,
                   help="stable consumer name; a restarted worker with the same id re-reads "
                        "its own pending jobs (default: <hostname>-<pid>)")
    w.add_argument("--log-level", default=None, choices=LOG_LEVELS, type=str.lower,
                   help="log level of the JSON logs on stderr "
                        "(default: $PAGEDQ_LOG_LEVEL or info)")
    w.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus metrics on this port "
                        "(default: $PAGEDQ_METRICS_PORT or 0 = off)")
    w.add_argument("--metrics-host", default=None, metavar="HOST",
                   help="address the metrics endpoint listens on; 0.0.0.0 = every interface "
                        "(default: $PAGEDQ_METRICS_HOST or 127.0.0.1)")
    w.add_argument("--lanes", default=None, metavar="A,B,...",
                   help="the lanes (jobs streams) to serve, highest first "
                        "(default: $PAGEDQ_LANES or interactive,batch)")
    w.add_argument("--prefixes", default=None, metavar="A,B,...",
                   help="serve the jobs of these tenants' key prefixes, fairly within each "
                        "lane (default: $PAGEDQ_PREFIXES, else just --prefix)")
    w.add_argument("--lane-min-share", type=float, default=None, metavar="F",
                   help="seats each lower lane keeps while it has work, as a share of "
                        "--max-num-seqs (default: $PAGEDQ_LANE_MIN_SHARE or 0.1)")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="'smollm2' (bundled), a local HF folder, or a .gguf file "
                        "(default: $PAGEDQ_MODEL or smollm2)")
    p.add_argument("--served-name", default=None,
                   help="jobs stream name for this model (default: the --model value if it "
                        "is a name, else the folder/file stem)")
    p.add_argument("--device", default=None,
                   help="auto, cpu, cuda or cuda:N (default: auto = cuda if available, "
                        "else cpu)")
    p.add_argument("--dtype", default=None,
                   help="auto, float32, bfloat16 or float16 (default: auto = bfloat16 "
                        "on CUDA, float32 on CPU)")
    p.add_argument("--max-num-seqs", type=int, default=None, metavar="N",
                   help="sequences in one engine step (default: 64)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                   help="token budget of one engine step, >= --max-num-seqs (default: 2048)")
    p.add_argument("--prefill-wait-steps", type=int, default=None, metavar="N",
                   help="decode-only steps a new job may wait so that arrivals are "
                        "prefilled together (a step that prefills costs more than a decode "
                        "step) (default: 4 with piecewise CUDA graphs, 16 with decode graphs "
                        "only (tensor-parallel), else 0)")
    p.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="longest sequence, prompt + output (default: the model's context "
                        "length, lowered to what the KV cache holds)")
    p.add_argument("--num-kv-blocks", type=int, default=None, metavar="N",
                   help="KV-cache blocks (default: sized from memory)")
    p.add_argument("--block-size", type=int, default=None, metavar="N",
                   help="tokens per KV block: 8, 16, 32, 64 or 128 (default: 16)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="F",
                   help="CUDA: share of the device's memory the engine may use, in (0, 1] "
                        "(default: 0.9)")
    p.add_argument("--kv-cache-memory-gb", type=float, default=None, metavar="GB",
                   help="CPU: memory of the KV cache when --num-kv-blocks is not given "
                        "(default: 1.0)")
    p.add_argument("--load-format", default=None, choices=["auto", "dummy"],
                   help="dummy: random weights from config.json alone, for benchmarks "
                        "(default: auto)")
    p.add_argument("--quantization", default=None,
                   choices=["auto", "awq", "gptq", "gguf", "none"],
                   help="how the weights are held: auto = as the checkpoint is quantized "
                        "(AWQ, GPTQ, GGUF Q4_0/Q4_1/Q8_0: kept quantized; dequantized at load "
                        "on the CPU in float32 and with tensor parallelism), none = plain "
                        "weights (a .gguf file dequantized to float) (default: auto)")
    p.add_argument("--kv-cache-dtype", default=None, choices=["auto", "fp8"],
                   help="fp8: float8_e4m3 KV cache, twice the tokens per GiB (accuracy: "
                        "docs/benchmarks.md) (default: auto = the model dtype)")
    p.add_argument("--scheduling-policy", default=None, choices=["priority", "fcfs"],
                   help="priority: higher lanes and priorities go first and may preempt "
                        "lower ones; fcfs: arrival order (default: priority)")
    onoff = argparse.BooleanOptionalAction
    p.add_argument("--enable-chunked-prefill", action=onoff, default=None,
                   help="split long prompts over several steps (default: on)")
    p.add_argument("--enable-prefix-caching", action=onoff, default=None,
                   help="share the KV blocks of common prompt prefixes (default: on)")
    p.add_argument("--enforce-eager", action=onoff, default=None,
                   help="no CUDA graphs (default: off)")
    p.add_argument("--async-scheduling", action=onoff, default=None,
                   help="schedule step N+1 before step N's tokens reach the host "
                        "(default: on for CUDA, off on the CPU)")
    p.add_argument("--use-triton", action=onoff, default=None,
                   help="Triton kernels (default: on for CUDA; the CPU runs kernels/cpu.py)")
    p.add_argument("--seed", type=int, default=None,
                   help="noise seed of jobs without their own seed (default: random per process, "
                        "so workers never share a noise stream)")
    p.add_argument("--tensor-parallel-size", type=int, default=None, metavar="N",
                   help="ranks sharing the model, one process and one GPU each (cuda:N.. "
                        "on --device cuda:N; gloo on cpu) (default: 1)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """LLMEngine keyword arguments of a parsed command line (flags > env > file > default)."""
    return resolve(args).engine_kwargs()


def settings_from(args: argparse.Namespace):
    """The service Settings of a parsed command line (flags > env > file > default)."""
    return resolve(args).service


# ---- configuration checks: one clear line and EXIT_CONFIG, never a traceback ----------

def check_settings(args: argparse.Namespace):
    """The service Settings, after check_config(args)."""
    return check_config(args).service


def check_config(args: argparse.Namespace) -> Resolved:
    """Every setting (flags, PAGEDQ_* variables, the config file) checked as far as it can
    be without loading torch; the effective configuration. Raises ConfigError."""
    cfg = resolve(args)
    settings = cfg.service
    from pagedq.producer.keys import check_name

    name_from = cfg.origin("served_name") if cfg.worker.served_name else \
        f"the stem of {cfg.origin('model')} (or give --served-name)"
    for kind, value, where in (("prefix", settings.prefix, cfg.origin("prefix")),
                               ("served model name", settings.model, name_from)):
        try:
            check_name(kind, value)
        except ValueError as e:
            raise ConfigError(f"{where}: {e}") from None
    from pagedq.producer import connection

    try:  # the URL parses; password and TLS files readable (connection.redis_kwargs)
        connection.check_offline(settings)
    except connection.RedisSetupError as e:
        raise ConfigError(str(e).replace("--redis-url / PAGEDQ_REDIS_URL",
                                         cfg.origin("redis_url"))) from None
    if settings.metrics_port:
        import socket

        try:
            socket.getaddrinfo(settings.metrics_host, settings.metrics_port)
        except (OSError, UnicodeError) as e:
            raise ConfigError(f"{cfg.origin('metrics_host')} {settings.metrics_host!r}"
                              f" is not an address of this host ({e}); give an IP address "
                              f"such as 127.0.0.1 or 0.0.0.0") from None
    from pagedq.engine.config import EngineConfig  # dataclasses only: no torch

    try:
        EngineConfig(**cfg.engine_kwargs()).validate()
    except ValueError as e:
        raise ConfigError(cfg.explain(str(e))) from None
    return cfg


def check_model(cfg: Resolved) -> None:
    """The model exists here (a name, folder or file) and its quantization is one pagedq
    serves (and the one asked for), before anything loads: no torch.
    Not part of check_config: `pagedq config` may describe another machine's worker."""
    from pagedq.engine.loader import resolve_model
    from pagedq.engine.quant.detect import detect

    dummy = cfg.worker.load_format == "dummy"
    try:
        source = resolve_model(cfg.worker.model, not dummy)
    except ValueError as e:
        raise ConfigError(f"{cfg.origin('model')}: {e}") from None
    try:  # its quantization (config files, a GGUF index): no weights read
        detect(source, cfg.worker.quantization, dummy)
    except ValueError as e:
        where = cfg.origin("quantization") if cfg.sources.get("quantization", "default") \
            != "default" else cfg.origin("model")
        raise ConfigError(f"{where}: {e}") from None


def build_engine(cfg: Resolved, on_stage=None):
    """LLMEngine(...) with the configuration errors it can raise as ConfigError.
    ``on_stage(text)`` hears the loading stages (engine/progress.py), from the first one
    after the device check: a bad device stays the only line on stderr."""
    import torch

    from pagedq.engine import progress
    from pagedq.engine.llm_engine import LLMEngine

    device, model = cfg.worker.device, cfg.worker.model
    m = re.fullmatch(r"cuda(?::(\d+))?", device)
    if m and not torch.cuda.is_available():
        raise ConfigError(f"{cfg.origin('device')} {device}: CUDA is not available on this "
                          f"machine; use cpu (or auto)")
    if m and m[1] and int(m[1]) >= torch.cuda.device_count():
        raise ConfigError(f"{cfg.origin('device')} {device}: this machine has "
                          f"{torch.cuda.device_count()} CUDA device(s), cuda:0 to "
                          f"cuda:{torch.cuda.device_count() - 1}")
    try:
        with progress.reporting(on_stage or (lambda _text: None)):
            return LLMEngine(model, **cfg.engine_kwargs())
    except ValueError as e:  # model path, device, max_model_len vs memory, ...
        raise ConfigError(cfg.explain(str(e))) from None
    except OSError as e:  # an unreadable model file or folder
        raise ConfigError(f"{cfg.origin('model')} {model!r} cannot be read: "
                          f"{' '.join(str(e).split())}") from None


def cmd_worker(args: argparse.Namespace) -> int:
    from pagedq.worker import logs

    cfg = check_config(args)
    check_model(cfg)
    logs.configure(cfg.worker.log_level)
    # wrong credentials or TLS set-up: exit 78 now, before the model loads; Redis not
    # answering is no error here (the worker starts and retries)
    from pagedq.producer import connection

    try:
        connection.probe(cfg.service)
    except connection.RedisUnusable as e:
        raise ConfigError(str(e)) from None
    from pagedq.worker.startup import StartReporter

    with StartReporter(cfg.service.model) as report:  # loading stages on stderr
        engine = build_engine(cfg, report.stage)
    from pagedq.worker.config_show import log_config
    from pagedq.worker.service import Worker

    w = Worker(engine, cfg.service, worker_id=cfg.worker.worker_id)
    # tensor-parallel: a rank process that dies ends the worker at once (exit 71), idle or
    # not; leases hand its jobs to other workers
    engine.set_failure_handler(lambda e: fatal.die("tensor-parallel", e, list(w.jobs)))
    report.ready(engine, cfg, w.worker_id)  # the start line, before the JSON logs
    log_config(cfg)  # after the last configuration check: a bad one stays one stderr line
    install_signal_handlers(w)
    try:
        w.run()
    except connection.RedisUnusable as e:  # refused at start, after the pre-check passed
        raise ConfigError(str(e)) from None
    return EXIT_CLEAN


def cmd_config(args: argparse.Namespace) -> int:
    from pagedq.worker.config_show import render

    print(render(check_config(args), as_json=args.json))
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
    from pagedq.worker.demo import run_demo

    check_model(check_config(args))  # the demo's worker would exit 78 into its log; say it here
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
    except BrokenPipeError:  # `pagedq config | head`: the reader left; stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports it


if __name__ == "__main__":
    sys.exit(main())
