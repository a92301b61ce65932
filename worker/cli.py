"""`pagedq worker` and `pagedq config` (the root parser: pagedq/cli.py), and the checks of a
worker's configuration that every command starting one runs (`pagedq demo` too). Heavy
imports (torch, the engine) happen only inside the worker command.

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

The client commands' exit codes are listed in pagedq/client_cli.py (and in ``pagedq -h``).
"""
from __future__ import annotations

import argparse
import os
import re
import signal
from collections.abc import Iterable

from pagedq.wire.declared import Declared
from pagedq.wire.settings import Settings
from pagedq.worker import fatal
from pagedq.worker.config import (
    SERVICE_FLAGS,
    ConfigError,
    Resolved,
    flag_default,
    flag_help,
    flag_name,
    plain,
    resolve,
)
from pagedq.worker.settings import ENGINE, PROCESS

EXIT_CLEAN = 0
# 70: the step watchdog (worker/liveness.py); 71: an unexpected error in a worker thread;
# 78: bad configuration. One definition, in worker/fatal.py (no torch import there).
EXIT_WEDGED, EXIT_THREAD_ERROR, EXIT_CONFIG = fatal.EXIT_WEDGED, fatal.EXIT_FAULT, fatal.EXIT_CONFIG

WORKER_EXIT_CODES_HELP = "exit codes of `pagedq worker`:\n" + __doc__.split(
    "Exit codes of ``pagedq worker``:\n\n", 1)[1].split("\nThe client commands'", 1)[0]

def register(sub: argparse._SubParsersAction, parents: Iterable[argparse.ArgumentParser]) -> None:
    """Add `pagedq worker` and `pagedq config`."""
    fmt, parents = argparse.RawDescriptionHelpFormatter, list(parents)
    w = sub.add_parser("worker", help="serve generation jobs from the model's jobs stream",
                       description="Serve generation jobs from the model's jobs stream. Each "
                                   "setting: flag > PAGEDQ_<NAME> > --config file > default "
                                   "(docs/configuration.md).",
                       parents=parents, epilog=WORKER_EXIT_CODES_HELP, formatter_class=fmt)
    add_worker_args(w)
    w.set_defaults(func=cmd_worker)

    c = sub.add_parser("config", help="print the worker's effective configuration and where "
                                      "each value comes from",
                       description="Print every worker setting (service and engine) as `pagedq "
                                   "worker` with the same options would use it, and its source: "
                                   "flag, env, file or default. Exit 78 if it is not valid.",
                       parents=parents, formatter_class=fmt)
    add_worker_args(c)
    c.add_argument("--json", action="store_true",
                   help="print one JSON object instead of a table (default: off)")
    c.set_defaults(func=cmd_config)


def add_worker_args(w: argparse.ArgumentParser) -> None:
    """The options of `pagedq worker` (and of `pagedq config`, which shows their effect):
    one per declared setting that has a flag (worker/settings.py, wire/engine_config.py)
    and per service flag (worker/config.py SERVICE_FLAGS), every default default None =
    not given, so that the environment and the config file apply underneath it."""
    w.add_argument("--config", default=None, metavar="FILE",
                   help="YAML file of settings, sections model/scheduler/cache/service; flags "
                        "and PAGEDQ_* variables override it (default: $PAGEDQ_CONFIG or none)")
    add_engine_args(w)
    for d in PROCESS:
        if d.setting.section == "service":
            add_flag(w, d)
    fields = Settings.model_fields
    for name, metavar in SERVICE_FLAGS.items():
        f = fields[name]
        w.add_argument(flag_name(name), dest=name, default=None, metavar=metavar,
                       type=f.annotation if f.annotation in (int, float) else str,
                       help=f"{plain(f.description)} (default: {flag_default(f.default)})")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The model's and the engine's options (`pagedq worker`, `pagedq demo`)."""
    for d in (*PROCESS, *ENGINE):
        if d.setting.section != "service":
            add_flag(p, d)


def add_flag(p: argparse.ArgumentParser, d: Declared) -> None:
    """``--<name>`` for declared setting ``d`` (a boolean: ``--<name>/--no-<name>``)."""
    s = d.setting
    if not s.flag:
        return
    kw: dict = {"dest": d.name, "default": None, "help": flag_help(d)}
    if d.base is bool:
        kw["action"] = argparse.BooleanOptionalAction
    else:
        kw["type"] = str.lower if s.lower else d.base
        if s.flag_choices:
            kw["choices"] = list(s.choices)
        elif s.metavar:
            kw["metavar"] = s.metavar
    p.add_argument(flag_name(d.name), **kw)


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
    from pagedq.wire.keys import check_name

    name_from = cfg.origin("served_name") if cfg.worker.served_name else \
        f"the stem of {cfg.origin('model')} (or give --served-name)"
    for kind, value, where in (("prefix", settings.prefix, cfg.origin("prefix")),
                               ("served model name", settings.model, name_from)):
        try:
            check_name(kind, value)
        except ValueError as e:
            raise ConfigError(f"{where}: {e}") from None
    from pagedq.wire import connection, redis_errors

    try:  # the URL parses; password and TLS files readable (connection.redis_kwargs)
        connection.check_offline(settings)
    except redis_errors.RedisSetupError as e:
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
    from pagedq.wire.engine_config import EngineConfig  # the engine's own rules, no engine import

    try:
        cfg.engine = EngineConfig(**cfg.engine_kwargs())  # validated by construction
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
    from pagedq.engine.config import EngineConfig
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
            return LLMEngine(model, config=cfg.engine or EngineConfig(**cfg.engine_kwargs()))
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
    from pagedq.wire import connection, redis_errors

    try:
        connection.probe(cfg.service)
    except redis_errors.RedisUnusable as e:
        raise ConfigError(str(e)) from None
    from pagedq.worker.startup import StartReporter

    with StartReporter(cfg.service.model) as report:  # loading stages on stderr
        engine = build_engine(cfg, report.stage)
    from pagedq.worker.config_show import log_config
    from pagedq.worker.service import Worker

    with engine:  # closed on the way out: its device memory, its tensor-parallel ranks
        w = Worker(engine, cfg.service, worker_id=cfg.worker.worker_id)
        # tensor-parallel: a rank process that dies ends the worker at once (exit 71), idle
        # or not; leases hand its jobs to other workers
        engine.set_failure_handler(lambda e: fatal.die("tensor-parallel", e, list(w.jobs)))
        report.ready(engine, cfg, w.worker_id)  # the start line, before the JSON logs
        log_config(cfg)  # after the last configuration check: a bad one stays one line
        install_signal_handlers(w)
        try:
            w.run()
        except redis_errors.RedisUnusable as e:  # refused at start, after the pre-check passed
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
