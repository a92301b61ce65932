"""The `pagedq` console script (and ``python -m pagedq``): the root parser, which takes each
package's commands from that package.

    worker, config      pagedq.worker.cli       (the service process; torch only inside it)
    demo                pagedq.demo
    serve               pagedq.serve            (Redis + workers + gateway, one command)
    submit, status,     pagedq.client_cli       (the job commands, over pagedq.producer)
    result, cancel,
    watch
    batch ...           pagedq.batch.cli
    acl, inspect, dlq   pagedq.admin.acl_cli, pagedq.admin.cli
    gateway ...         pagedq.gateway.cli      (no web framework imported here)

``--redis-url`` and ``--prefix`` are accepted before or after the subcommand; given in
both places, the one after the subcommand wins. Building the parser imports no torch and no
web framework (tests/test_architecture.py). The exit codes: pagedq/exits.py (the job and
batch commands' table: pagedq/client_cli.py) and worker/cli.py (``pagedq worker``).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from pagedq import client_cli
from pagedq.wire.settings import Settings


def version() -> str:
    """The installed pagedq version; from pyproject.toml when running from a checkout
    without the distribution installed."""
    try:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as dist_version

        return dist_version("pagedq")
    except PackageNotFoundError:
        pass
    try:
        text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
        m = re.search(r'(?m)^version\s*=\s*"([^"]+)"', text)
        return m.group(1) if m else "unknown"
    except OSError:
        return "unknown"


def common_options(after_subcommand: bool) -> argparse.ArgumentParser:
    """``--redis-url`` and ``--prefix`` as a parent parser: once for the root parser
    (defaults None) and once for every subparser (defaults SUPPRESS, so a value given
    before the subcommand survives unless one is given after it too)."""
    p = argparse.ArgumentParser(add_help=False)
    default = argparse.SUPPRESS if after_subcommand else None
    fields = Settings.model_fields
    p.add_argument("--redis-url", metavar="URL", default=default,
                   help="Redis to use, rediss:// for TLS; give the password by "
                        "$PAGEDQ_REDIS_PASSWORD(_FILE), not here (docs/deployment.md) "
                        f"(default: $PAGEDQ_REDIS_URL or {fields['redis_url'].default})")
    p.add_argument("--prefix", default=default,
                   help=f"key prefix (default: $PAGEDQ_PREFIX or {fields['prefix'].default})")
    return p


def build_parser() -> argparse.ArgumentParser:
    from pagedq import demo, serve
    from pagedq.admin import acl_cli
    from pagedq.admin import cli as admin_cli
    from pagedq.batch import cli as batch_cli
    from pagedq.gateway import cli as gateway_cli
    from pagedq.worker import cli as worker_cli

    fmt = argparse.RawDescriptionHelpFormatter
    epilog = client_cli.EXIT_CODES_HELP + "\n" + worker_cli.WORKER_EXIT_CODES_HELP
    p = argparse.ArgumentParser(prog="pagedq", description="Queue-fed LLM generation over Redis.",
                                parents=[common_options(after_subcommand=False)],
                                epilog=epilog, formatter_class=fmt)
    p.add_argument("--version", action="version", version=f"pagedq {version()}",
                   help="print 'pagedq <version>' and exit")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    after = [common_options(after_subcommand=True)]
    worker_cli.register(sub, after)
    demo.register(sub, after)
    serve.register(sub, after)  # `pagedq serve MODEL` (docs/gateway.md)
    client_cli.register(sub, after)
    batch_cli.register(sub, after)  # `pagedq batch ...` (docs/batches.md)
    acl_cli.register(sub, after)  # `pagedq acl` (docs/security.md)
    admin_cli.register(sub, after)  # `pagedq inspect`, `pagedq dlq ...`
    gateway_cli.register(sub, after)  # `pagedq gateway ...` (docs/gateway.md)
    return p


def main(argv: list[str] | None = None) -> int:
    from pagedq.worker.config import ConfigError
    from pagedq.worker.fatal import EXIT_CONFIG

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
