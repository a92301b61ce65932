"""``pagedq batch ...``: submit, status, results, cancel, retry, list, worker.

``register(subparsers, parents)`` adds the ``batch`` group (pagedq/cli.py calls it).
``--redis-url``/``--prefix`` go anywhere: before ``batch``, after it, or after the
subcommand (the last one wins). Every option's help shows its default.

Exit codes (the numbers and meanings of pagedq/client_cli.py's table, for batches):

   0  done: the command did what it was asked (submit/retry waiting: the batch completed)
   1  Redis or another error; cancel of a batch already ended; retry with nothing to retry
   2  invalid input: nothing was created (bad file, over the limits, bad option value)
   3  batch not found (never created, or its record expired)
   4  --timeout ran out while waiting (the batch goes on)
   6  the batch failed (no valid line: the error file says why)
   7  the batch was cancelled
   8  the batch expired (its completion window ran out)
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterable

from pagedq.exits import (  # the batch commands' codes are the job commands' (docs/batches.md)
    EXIT_ERROR,
    EXIT_INVALID,  # noqa: F401 - public: bad input
    EXIT_JOB_CANCELLED,
    EXIT_JOB_EXPIRED,
    EXIT_JOB_FAILED,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_TIMEOUT,  # noqa: F401 - public: --timeout ran out
    guarded,
)
from pagedq.wire.errors import InvalidRequest, JobNotFound, ResultTimeout
from pagedq.wire.settings import Settings

from .api import Batches
from .record import Batch, BatchStateError
from .record import BatchStatus as S
from .settings import BatchSettings

# the job commands' numbers (pagedq/client_cli.py): a batch ends as a job does
EXIT_FAILED, EXIT_CANCELLED, EXIT_EXPIRED = EXIT_JOB_FAILED, EXIT_JOB_CANCELLED, EXIT_JOB_EXPIRED
EXIT_OF_STATUS = {S.completed: EXIT_OK, S.failed: EXIT_FAILED, S.cancelled: EXIT_CANCELLED,
                  S.expired: EXIT_EXPIRED}
HINT_AFTER_S = 5.0  # a batch still waiting after this long gets a hint on what is missing
LOG_EVERY_S = 10.0  # progress lines when stderr is not a terminal
EXIT_CODES_HELP = "exit codes:\n" + __doc__.split("for batches):\n\n", 1)[1]
_BS = BatchSettings.model_fields


def _batches(args: argparse.Namespace) -> Batches:
    kw = {}
    if getattr(args, "batch_dir", None):
        kw["batch_dir"] = args.batch_dir
    if getattr(args, "queue", None):
        kw["batch_queue"] = args.queue
    return Batches(getattr(args, "redis_url", None), prefix=getattr(args, "prefix", None),
                   model=getattr(args, "model", None), batch_settings=BatchSettings(**kw))


def _batch_error(e: Exception) -> tuple[int, str] | None:
    """The batch commands' errors that the job commands' mapping (pagedq/client_cli.py) would
    word or number differently."""
    if isinstance(e, InvalidRequest | ValueError | ResultTimeout):
        return None
    if isinstance(e, JobNotFound):  # BatchNotFound
        return EXIT_NOT_FOUND, f"batch not found: {e.args[0] if e.args else ''}"
    if isinstance(e, ImportError):
        return EXIT_ERROR, f"{e}: batches need rq (pip install 'rq>=2.0')"
    if isinstance(e, BatchStateError):
        return EXIT_ERROR, str(e)
    return EXIT_ERROR, f"{type(e).__name__}: {e}"


def _guarded(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    return guarded(fn, _batch_error)


# ---------------------------------------------------------------- following a batch

def progress_line(b: Batch, width: int = 30) -> str:
    c = b.request_counts
    done = c.completed + c.failed
    filled = int(width * done / c.total) if c.total else 0
    return (f"[{'#' * filled}{'-' * (width - filled)}] {done}/{c.total or '?'} "
            f"({c.completed} completed, {c.failed} failed) {b.status.value}")


def hints(bt: Batches, b: Batch) -> list[str]:
    """Why a running batch may not move: no rq worker, or no pagedq worker for its model."""
    out = []
    if not b.done and bt.rq_workers(b.queue) == 0:
        out.append(f"no rq worker listens on queue {b.queue!r}: start one with "
                   f"`pagedq batch worker --queue {b.queue}`")
    if b.status == S.in_progress and b.model not in bt.client.served_models():
        out.append(f"no pagedq worker serves model {b.model!r}: its requests wait")
    return out


def follow(bt: Batches, batch_id: str, timeout: float | None) -> int:
    """Progress on stderr until the batch ends; exit code of its final status. On a
    terminal the bar is redrawn in place; otherwise (a log) a line is written when the
    status changes, at most every LOG_EVERY_S otherwise."""
    tty = sys.stderr.isatty()
    last = {"line": "", "status": "", "at": 0.0}
    hint_at = [time.monotonic() + HINT_AFTER_S]

    def show(b: Batch) -> None:
        now = time.monotonic()
        if hint_at[0] and now > hint_at[0]:
            hint_at[0] = 0  # once
            for h in hints(bt, b):
                print(("\n" if tty and last["line"] else "") + f"pagedq: {h}", file=sys.stderr)
                last["line"] = ""
        line = progress_line(b)
        if line == last["line"] or not (tty or b.done or b.status != last["status"]
                                        or now - last["at"] >= LOG_EVERY_S):
            return
        print(("\r" + line) if tty else line, end="" if tty else "\n", file=sys.stderr,
              flush=True)
        last.update(line=line, status=b.status, at=now)
    b = bt.wait(batch_id, timeout=timeout, on_progress=show)
    if tty:
        print(file=sys.stderr)
    return _report(b)


def _report(b: Batch) -> int:
    code = EXIT_OF_STATUS.get(b.status, EXIT_ERROR)
    if code != EXIT_OK:
        print(f"pagedq: batch {b.id} {b.status.value}; errors: {b.error_file}", file=sys.stderr)
    return code


# ---------------------------------------------------------------- commands

def cmd_submit(args: argparse.Namespace) -> int:
    meta = {}
    for kv in args.metadata or []:
        k, sep, v = kv.partition("=")
        if not sep:
            raise ValueError(f"--metadata {kv!r}: use KEY=VALUE")
        meta[k] = v
    with _batches(args) as bt:
        b = bt.create(args.file, model=args.model, completion_window=args.completion_window,
                      metadata=meta or None)
        print(b.id, flush=True)
        return EXIT_OK if args.detach else follow(bt, b.id, args.timeout)


def cmd_retry(args: argparse.Namespace) -> int:
    with _batches(args) as bt:
        b = bt.retry(args.id, completion_window=args.completion_window)
        print(b.id, flush=True)
        return EXIT_OK if args.detach else follow(bt, b.id, args.timeout)


def cmd_status(args: argparse.Namespace) -> int:
    with _batches(args) as bt:
        b = bt.retrieve(args.id)
        print(b.model_dump_json())
        for h in hints(bt, b):
            print(f"pagedq: {h}", file=sys.stderr)
    return EXIT_OK


def cmd_results(args: argparse.Namespace) -> int:
    with _batches(args) as bt:
        b = bt.retrieve(args.id)
        n_out, n_err = bt.write_results(args.id, output=args.output, errors=args.errors,
                                        stream=sys.stdout)
    partial = "" if b.done else f" so far (batch {b.status.value}: partial)"
    print(f"pagedq: {n_out} results, {n_err if args.errors else 'no'} error lines written"
          f"{partial}", file=sys.stderr)
    return EXIT_OK


def cmd_cancel(args: argparse.Namespace) -> int:
    with _batches(args) as bt:
        print(bt.cancel(args.id).status.value)
    return EXIT_OK


def cmd_list(args: argparse.Namespace) -> int:
    if args.limit < 1:
        raise ValueError(f"--limit {args.limit}: must be at least 1")
    with _batches(args) as bt:
        for b in bt.list(args.limit):
            print(b.model_dump_json())
    return EXIT_OK


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is no port: use 0 (off) to 65535")
    return port


def cmd_worker(args: argparse.Namespace) -> int:
    from .worker import run_worker

    settings = Settings(**{k: v for k, v in (("redis_url", getattr(args, "redis_url", None)),
                                             ("prefix", getattr(args, "prefix", None))) if v})
    kw = {"batch_queue": args.queue} if args.queue else {}
    if args.metrics_port is not None:
        kw["batch_metrics_port"] = args.metrics_port
    if args.metrics_host:
        kw["batch_metrics_host"] = args.metrics_host
    run_worker(settings.redis_url, settings.prefix, settings, BatchSettings(**kw),
               name=args.name, burst=args.burst, log_level=args.log_level.upper())
    return EXIT_OK


# ---------------------------------------------------------------- parser

def register(subparsers: argparse._SubParsersAction,
             parents: Iterable[argparse.ArgumentParser]) -> None:
    parents = list(parents)
    fmt = argparse.RawDescriptionHelpFormatter
    group = subparsers.add_parser(
        "batch", help="bulk generation: OpenAI Batch JSONL files through rq",
        description="Bulk generation: OpenAI Batch JSONL files through rq (docs/batches.md).",
        parents=parents, epilog=EXIT_CODES_HELP, formatter_class=fmt)
    sub = group.add_subparsers(dest="batch_command", required=True, metavar="COMMAND")

    def add(name: str, help: str, fn: Callable[[argparse.Namespace], int]
            ) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help, parents=parents,
                           epilog=EXIT_CODES_HELP, formatter_class=fmt)
        p.set_defaults(func=_guarded(fn))
        return p

    def window(p: argparse.ArgumentParser, default: str) -> None:
        p.add_argument("--completion-window", metavar="W", default=None,
                       help=f"time to finish in, N followed by s/m/h/d, up to 7d "
                            f"(default: {default})")

    def follow_opts(p: argparse.ArgumentParser) -> None:
        p.add_argument("--detach", action="store_true",
                       help="print the batch id and return (default: off, show progress on "
                            "stderr until the batch ends)")
        p.add_argument("--timeout", type=float, metavar="S",
                       help="most seconds to wait for the end (default: none, wait forever); "
                            "exit 4 when it runs out")

    def control(p: argparse.ArgumentParser) -> None:
        p.add_argument("--batch-dir", metavar="DIR",
                       help="folder of the batch folders (default: $PAGEDQ_BATCH_DIR, else "
                            "$XDG_DATA_HOME/pagedq/batches or ~/.local/share/pagedq/batches)")
        p.add_argument("--queue", metavar="NAME",
                       help=f"rq queue of the control plane (default: $PAGEDQ_BATCH_QUEUE or "
                            f"{_BS['batch_queue'].default})")

    p = add("submit", "submit an OpenAI Batch JSONL file; prints the batch id", cmd_submit)
    p.add_argument("file", metavar="FILE", help="the JSONL file, one request a line")
    p.add_argument("--model", help="the model of every line (default: $PAGEDQ_MODEL or "
                                   f"{Settings.model_fields['model'].default})")
    window(p, f"$PAGEDQ_BATCH_COMPLETION_WINDOW or {_BS['batch_completion_window'].default}")
    p.add_argument("--metadata", action="append", metavar="KEY=VALUE",
                   help="a metadata pair, repeatable (default: none)")
    follow_opts(p)
    control(p)

    p = add("status", "print a batch as JSON, with its live request counts", cmd_status)
    p.add_argument("id", metavar="ID")

    p = add("results", "write a batch's output lines (partial while it runs)", cmd_results)
    p.add_argument("id", metavar="ID")
    p.add_argument("-o", "--output", metavar="FILE",
                   help="write the output JSONL here (default: stdout)")
    p.add_argument("--errors", metavar="FILE",
                   help="also write the error JSONL here (default: not written)")

    p = add("cancel", "cancel a batch: queued requests never start, running ones stop, "
                      "finished ones stay in the output; prints its status", cmd_cancel)
    p.add_argument("id", metavar="ID")

    p = add("retry", "submit a batch's failed, expired and cancelled lines as a new batch "
                     "(retry_of = ID); prints the new id", cmd_retry)
    p.add_argument("id", metavar="ID")
    window(p, "the old batch's")
    follow_opts(p)
    control(p)

    p = add("list", "print the newest batches as JSON lines, newest first", cmd_list)
    p.add_argument("--limit", type=int, default=20, metavar="N",
                   help="how many (default: %(default)s)")

    p = add("worker", "run an rq worker (JSON serializer, with scheduler) for the batch "
                      "control plane", cmd_worker)
    p.add_argument("--queue", metavar="NAME",
                   help=f"rq queue to work on (default: $PAGEDQ_BATCH_QUEUE or "
                        f"{_BS['batch_queue'].default})")
    p.add_argument("--name", help="rq worker name, unique among live workers "
                                  "(default: a random one)")
    p.add_argument("--burst", action="store_true",
                   help="quit when the queue is empty (default: off, run until SIGTERM)")
    p.add_argument("--log-level", default="info", type=str.lower,
                   choices=("debug", "info", "warning", "error"),
                   help="rq's log level on stderr (default: %(default)s)")
    p.add_argument("--metrics-port", type=_port, metavar="PORT",
                   help="serve Prometheus metrics on this port, 0 = off (default: "
                        "$PAGEDQ_BATCH_METRICS_PORT or 0)")
    p.add_argument("--metrics-host", metavar="HOST",
                   help="address of /metrics (default: $PAGEDQ_BATCH_METRICS_HOST or "
                        f"{_BS['batch_metrics_host'].default})")
