"""The CLI's exit codes (the table in pagedq/client_cli.py's docstring) and its error
wrapper, shared by every package's commands: the job commands (pagedq/client_cli.py), the
batch commands (batch/cli.py), the admin and ACL commands (admin/) and the gateway's.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from pagedq.wire.errors import InvalidRequest, JobConflict, JobNotFound, Overloaded, ResultTimeout
from pagedq.wire.redis_errors import RedisUnusable, is_fatal

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_INVALID = 2
EXIT_NOT_FOUND = 3
EXIT_TIMEOUT = 4
EXIT_REFUSED = 5
EXIT_JOB_FAILED = 6
EXIT_JOB_CANCELLED = 7
EXIT_JOB_EXPIRED = 8


def guarded(fn: Callable[[argparse.Namespace], int],
            first: Callable[[Exception], tuple[int, str] | None] = lambda e: None,
            ) -> Callable[[argparse.Namespace], int]:
    """Typed errors -> one line on stderr + exit code, never a traceback. ``first`` maps
    a command group's own errors (None: the job commands' mapping below applies)."""
    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except KeyboardInterrupt:
            return 130
        except Exception as e:  # a CLI reports, it does not trace back
            code, msg = _unusable(e, args) or first(e) or _job_error(e)
        print(f"pagedq: {' '.join(msg.split())}", file=sys.stderr)
        return code
    return run


def _unusable(e: Exception, args: argparse.Namespace) -> tuple[int, str] | None:
    """Redis refusing the credentials or the TLS set-up, for every command group alike:
    ``cannot use Redis at <redacted url>: why``, exit 1 (wire/redis_errors.py)."""
    if not is_fatal(e):
        return None
    if not isinstance(e, RedisUnusable):  # raised outside a client's retry loop
        url = getattr(args, "redis_url", None)
        if not url:
            from pagedq.wire.settings import Settings

            try:
                url = Settings().redis_url
            except ValueError:
                url = "?"
        e = RedisUnusable(url, e)
    return EXIT_ERROR, str(e)


def _job_error(e: Exception) -> tuple[int, str]:
    if isinstance(e, InvalidRequest | ValueError):  # ValueError: bad --prefix/--model
        return EXIT_INVALID, str(e)
    if isinstance(e, JobNotFound):
        return EXIT_NOT_FOUND, f"job not found: {e.args[0] if e.args else ''}"
    if isinstance(e, ResultTimeout):
        return EXIT_TIMEOUT, str(e)
    if isinstance(e, Overloaded | JobConflict):
        return EXIT_REFUSED, str(e)
    return EXIT_ERROR, f"{type(e).__name__}: {e}"
