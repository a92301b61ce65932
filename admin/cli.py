"""``pagedq inspect`` and ``pagedq dlq list|requeue`` (and ``pagedq functions``, admin/
functions_cli.py): the queue, the dead letters and the
workers without redis-cli (docs/protocol.md "Inspecting a deployment and dead letters").

``register(subparsers, parents)`` adds them (pagedq/cli.py calls it). Options go in any
position; ``--redis-url``/``--prefix`` as for every client command.

Exit codes (the numbers of pagedq/client_cli.py's table):

   0  done (requeue: every ID was requeued)
   1  Redis or another error
   2  invalid input: a bad option value, ID or model name; an ID that names several
      entries; an entry whose stored request cannot be submitted again (truncated,
      invalid, ...: nothing submitted, the entry kept)
   3  not found: no such model (inspect/list --model), no DLQ entry with that ID
   5  requeue refused by SUBMIT: queue overloaded
With several IDs each is handled on its own; the exit code is the first failure's.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

from pagedq.exits import EXIT_NOT_FOUND, EXIT_OK, guarded
from pagedq.producer.client import Client
from pagedq.wire.keys import Keys, check_lane
from pagedq.wire.settings import Settings

from . import dlq, functions_cli, inspect_text
from .inspection import ModelNotFound, model_lanes, snapshot

EXIT_CODES_HELP = "exit codes:\n" + __doc__.split("table):\n\n", 1)[1]
WATCH_DEFAULT_S = 2.0
EXIT_INTERRUPTED = 130  # guarded()'s code for Ctrl-C


def _admin_error(e: Exception) -> tuple[int, str] | None:
    """Not-found errors of these commands; everything else as the job commands map it."""
    if isinstance(e, ModelNotFound | dlq.DeadEntryNotFound):
        return EXIT_NOT_FOUND, str(e.args[0]) if e.args else type(e).__name__
    return None


def _guarded(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    return guarded(fn, _admin_error)


class _Admin:
    """Settings, keys and a reading connection from the command line's options."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.settings = Settings()
        self.url = getattr(args, "redis_url", None) or self.settings.redis_url
        self.keys = Keys(getattr(args, "prefix", None) or self.settings.prefix)
        self.spaces = self.keys.spaces(self.settings.partitions)  # every partition's keys
        self.r = dlq.admin_redis(self.settings, self.url)

    def __enter__(self) -> _Admin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.r.close()

    def streams(self, model: str | None, lane: str | None) -> list[tuple[str, str]]:
        """(model, lane) of every DLQ stream to look at."""
        if lane is not None:
            check_lane(lane)
        return [(m, ln) for m, lanes in model_lanes(self.r, self.keys, self.settings.lanes,
                                                    model, self.settings.partitions).items()
                for ln in lanes if lane in (None, ln)]


def _positive(kind: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError:
            v = None
        if v is None or not 0 < v < float("inf"):
            raise argparse.ArgumentTypeError(f"must be a positive number, not {text!r}")
        return v
    return parse


def cmd_inspect(args: argparse.Namespace) -> int:
    try:
        return _inspect(args)
    except KeyboardInterrupt:  # Ctrl-C is the way out of --watch
        if args.watch:
            return EXIT_OK
        raise


def _inspect(args: argparse.Namespace) -> int:
    with _Admin(args) as a:
        return _show(a, args)


def _show(a: _Admin, args: argparse.Namespace) -> int:
    tty = sys.stdout.isatty()
    while True:
        snap = snapshot(a.r, a.keys, a.settings.lanes, args.model, args.count,
                        a.settings.partitions)
        if args.json:
            text = json.dumps(snap, indent=None if args.watch else 2)
        else:
            text = inspect_text.render(snap, args.count)
        if args.watch and tty and not args.json:
            text = "\x1b[H\x1b[2J" + text  # redraw in place
        print(text, flush=True)
        if not args.watch:
            return EXIT_OK
        time.sleep(args.watch)
        if not args.json and not tty:
            print()


def cmd_dlq_list(args: argparse.Namespace) -> int:
    with _Admin(args) as a:
        return _list(a, args)


def _list(a: _Admin, args: argparse.Namespace) -> int:
    now = dlq.redis_now(a.r)
    found = [e for m, lane in a.streams(args.model, args.lane)
             for e in _newest(dlq.read(a.r, k, m, lane, args.count or None) for k in a.spaces)
             [:args.count or None]]
    entries = [e.to_json(now, body=args.json) for e in found]
    if args.json:
        print(json.dumps(entries, indent=2))
    elif entries:
        print("\n".join(inspect_text.table(inspect_text.DEAD_HEADERS,
                                           inspect_text.dead_rows(entries),
                                           inspect_text.DEAD_ALIGN)))
    else:
        print("no dead letters")
    return EXIT_OK


def _newest(per_partition: Iterable[list[dlq.DeadEntry]]) -> list[dlq.DeadEntry]:
    """One stream's entries of every partition, newest first (entry ids are times)."""
    entries = [e for part in per_partition for e in part]
    return sorted(entries, key=lambda e: tuple(map(int, e.id.split("-"))), reverse=True)


def cmd_dlq_requeue(args: argparse.Namespace) -> int:
    with _Admin(args) as a:
        return _requeue(a, args)


def _requeue(a: _Admin, args: argparse.Namespace) -> int:
    if bool(args.ids) == args.all:
        raise ValueError("give entry or job IDs, or --all (with --model)")
    if args.all and not args.model:
        raise ValueError("--all needs --model (and takes --lane)")
    streams = a.streams(args.model, args.lane)
    targets: list[Callable[[], dlq.DeadEntry]]  # looked up one at a time, as they are done
    if args.all:
        found = [e for m, lane in streams
                 for e in _newest(dlq.read(a.r, k, m, lane) for k in a.spaces)]
        targets = [lambda e=e: e for e in reversed(found)]  # oldest first
    else:
        targets = [lambda i=i: dlq.find(a.r, a.spaces, streams, i) for i in args.ids]
    code = EXIT_OK
    with Client(a.url, prefix=a.keys.prefix, settings=a.settings) as client:
        for entry in targets:
            def one(_args: argparse.Namespace, entry=entry) -> int:
                print(dlq.requeue(client, a.r, a.keys, entry()), flush=True)
                return EXIT_OK
            got = _guarded(one)(args)  # one error line per failed ID, then the next ID
            if got == EXIT_INTERRUPTED:  # Ctrl-C stops the whole command
                return got
            code = code or got
    return code


def register(subparsers: argparse._SubParsersAction,
             parents: Iterable[argparse.ArgumentParser]) -> None:
    parents = list(parents)
    fmt = argparse.RawDescriptionHelpFormatter

    def common(p: argparse.ArgumentParser, as_json: bool = True) -> None:
        p.add_argument("--model", metavar="M",
                       help="only this model (default: every model: those of {P}:models "
                            "and any with a jobs or DLQ stream)")
        if as_json:
            p.add_argument("--json", action="store_true",
                           help="print one JSON document (default: off, aligned tables)")

    help_ = "show each model's lanes (queued, pending, dead letters) and the live workers"
    p = subparsers.add_parser("inspect", help=help_, description=help_ + ".", parents=parents,
                              epilog=EXIT_CODES_HELP, formatter_class=fmt)
    common(p)
    p.add_argument("--count", type=_positive(int), default=5, metavar="N",
                   help="oldest pending and newest dead entries listed per lane "
                        "(default: %(default)s)")
    p.add_argument("--watch", type=_positive(float), nargs="?", const=WATCH_DEFAULT_S,
                   default=None, metavar="S",
                   help="show it again every S seconds until Ctrl-C; --json then prints one "
                        f"document a line (default: off; --watch alone: {WATCH_DEFAULT_S:g})")
    p.set_defaults(func=_guarded(cmd_inspect))

    group = subparsers.add_parser(
        "dlq", help="list dead-lettered entries, requeue them as new jobs",
        description="List dead-lettered entries, requeue them as new jobs (docs/protocol.md "
                    "\"Requeueing a dead letter\").", parents=parents, epilog=EXIT_CODES_HELP,
        formatter_class=fmt)
    sub = group.add_subparsers(dest="dlq_command", required=True, metavar="COMMAND")

    def add(name: str, help: str, fn: Callable[[argparse.Namespace], int]
            ) -> argparse.ArgumentParser:
        q = sub.add_parser(name, help=help, description=help, parents=parents,
                           epilog=EXIT_CODES_HELP, formatter_class=fmt)
        common(q, as_json=name == "list")
        q.add_argument("--lane", metavar="L", help="only this lane (default: every lane)")
        q.set_defaults(func=_guarded(fn))
        return q

    q = add("list", "list dead-lettered entries, newest first, with their reasons",
            cmd_dlq_list)
    q.add_argument("--count", type=_positive(int), default=50, metavar="N",
                   help="newest entries per lane (default: %(default)s)")
    q = add("requeue", "submit dead-lettered requests again as new jobs <job>.r<k>, then "
                       "delete their entries; prints each new job id", cmd_dlq_requeue)
    q.add_argument("ids", nargs="*", metavar="ID",
                   help="a DLQ entry id (as dlq list prints) or a dead job's id")
    q.add_argument("--all", action="store_true",
                   help="every entry of --model (and --lane), oldest first (default: off)")
    functions_cli.register(subparsers, parents)  # `pagedq functions load|show`
