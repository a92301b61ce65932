"""A worker is healthy or gone: an unexpected exception in any of its threads ends the
process with a distinct exit code, so its supervisor restarts it and, through lease
expiry, other workers take over its jobs. A half-alive worker (engine stepping with no
publisher, or a publisher with no engine) would keep its jobs hostage instead.

Exit codes of `pagedq worker`: 0 clean stop, 70 a wedged engine step (liveness.Watchdog),
71 an unexpected error in a worker thread (this module), 78 bad configuration (cli).
"""
from __future__ import annotations

import os
import sys
import threading
import traceback
from collections.abc import Callable, Iterable
from typing import NoReturn

import structlog

EXIT_WEDGED = 70
EXIT_FAULT = 71
EXIT_CONFIG = 78

log = structlog.get_logger("pagedq.fatal")
_dying = threading.Lock()


def die(thread: str, exc: BaseException, job_ids: Iterable[str] = ()) -> NoReturn:
    """Log the fault with the jobs involved and end the process at once (no cleanup: the
    state of a faulted worker is not to be trusted; leases hand its jobs over)."""
    with _dying:  # two threads faulting together: one report, one exit
        ids = sorted(job_ids)
        log.critical("worker_fault", thread=thread, error=f"{type(exc).__name__}: {exc}",
                     job_ids=ids[:100], jobs=len(ids),
                     traceback="".join(traceback.format_exception(exc)))
        flush_and_exit(EXIT_FAULT)


def flush_and_exit(code: int) -> NoReturn:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
    os._exit(code)


def guarded(thread: str, target: Callable[[], None],
            job_ids: Callable[[], Iterable[str]] = lambda: ()) -> Callable[[], None]:
    """``target`` as a thread body that dies loudly instead of ending the thread quietly."""
    def run() -> None:
        try:
            target()
        except BaseException as e:  # noqa: BLE001 - any escape from a worker thread is fatal
            try:
                ids = list(job_ids())
            except Exception:  # noqa: BLE001
                ids = []
            die(thread, e, ids)
    return run
