"""``pagedq functions load|show``: pagedq's Redis function libraries (Redis >= 7), at
deploy time.

Producers, batch and gateway users run pagedq's scripts as functions of the library
``pagedq`` (and rq's as those of ``pagedq_rq``: pagedq.wire.lua) and may not load them; a
worker loads them at its start (and again when Redis lost them), this command as admin
before any worker runs (``load``: loads what is missing or of another version, in place), or
prints them for redis-cli (``show``: ``pagedq functions show | redis-cli -x FUNCTION LOAD
REPLACE``). Exit codes: 0 done; 1 Redis or another error (a user that may not load
functions).
"""
from __future__ import annotations

import argparse
from collections.abc import Iterable

from pagedq.exits import EXIT_OK, guarded
from pagedq.wire import lua, script
from pagedq.wire.connection import connect
from pagedq.wire.lua import rq_scripts
from pagedq.wire.settings import Settings


def cmd_load(args: argparse.Namespace) -> int:
    settings = Settings()
    r = connect(settings, getattr(args, "redis_url", None) or settings.redis_url)
    try:
        if not script.prepare(r):
            print("Redis < 7 has no functions: pagedq runs its scripts by EVALSHA there")
            return EXIT_OK
        found = script.ensure_library(r)
    finally:
        r.close()
    what = f"pagedq {lua.library_version(settings.redis_cluster)}"
    if rq_scripts.version() and not settings.redis_cluster:
        what += f", pagedq_rq {rq_scripts.version()}"
    print(f"loaded {what}" + (f" (replacing {found})" if found else "") if found is not None
          else f"already loaded: {what}")
    return EXIT_OK


def cmd_show(args: argparse.Namespace) -> int:
    print(rq_scripts.library() if args.rq else lua.library(args.cluster), end="")
    return EXIT_OK


def register(subparsers: argparse._SubParsersAction,
             parents: Iterable[argparse.ArgumentParser]) -> None:
    parents, fmt = list(parents), argparse.RawDescriptionHelpFormatter
    doc = __doc__.split("\n\n", 1)[1]
    group = subparsers.add_parser("functions", help="load or show pagedq's Redis function "
                                  "libraries (Redis >= 7)", description=doc,
                                  parents=parents, formatter_class=fmt)
    sub = group.add_subparsers(dest="functions_command", required=True, metavar="COMMAND")
    p = sub.add_parser("load", help="load the libraries unless Redis has these versions",
                       description=doc, parents=parents, formatter_class=fmt)
    p.set_defaults(func=guarded(cmd_load))
    p = sub.add_parser("show", help="print a library's text (for redis-cli -x FUNCTION LOAD)",
                       description=doc, parents=parents, formatter_class=fmt)
    p.add_argument("--rq", action="store_true",
                   help="rq's scripts' library, pagedq_rq (default: off, pagedq's own)")
    p.add_argument("--cluster", action="store_true",
                   help="the text for a Redis Cluster: SPUBLISH (default: off)")
    p.set_defaults(func=guarded(cmd_show))
