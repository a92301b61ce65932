"""Failpoints for fault-injection tests (off unless PAGEDQ_FAILPOINTS is set).

PAGEDQ_FAILPOINTS="crash_on_prompt=POISON,step_sleep_s=0.2,wedge_on_prompt=HANG"
  crash_on_prompt  : the process dies (os._exit, like a segfault) when it admits a job
                     whose prompt contains the marker
  wedge_on_prompt  : the next engine step hangs forever once such a job is admitted
  step_sleep_s     : every engine step takes this much longer (slow GPU)
  token_sleep_ms   : every engine step takes this much longer per token it computes
                     (a slow device: long prefills make long steps)
  raise_in_<thread>: an unexpected exception in that thread while it handles a job whose
                     id contains the marker; thread is one of intake, intake_read (the
                     busy reader), engine, publisher, heartbeat (tests of worker/fatal.py)
"""
from __future__ import annotations

import os
import time
from collections.abc import Iterable

FAILPOINTS = {}
for _part in filter(None, (p.strip() for p in os.environ.get("PAGEDQ_FAILPOINTS", "").split(","))):
    _k, _, _v = _part.partition("=")
    FAILPOINTS[_k] = _v
_wedge = False


class InjectedFault(RuntimeError):
    pass


def on_admit(text: str) -> None:
    if not FAILPOINTS:
        return
    marker = FAILPOINTS.get("crash_on_prompt")
    if marker and marker in text:
        os._exit(86)
    marker = FAILPOINTS.get("wedge_on_prompt")
    if marker and marker in text:
        global _wedge
        _wedge = True


def on_step(tokens: int = 0) -> None:
    if not FAILPOINTS:
        return
    while _wedge:  # a hung kernel / driver call
        time.sleep(3600)
    if "step_sleep_s" in FAILPOINTS:
        time.sleep(float(FAILPOINTS["step_sleep_s"]))
    if "token_sleep_ms" in FAILPOINTS:
        time.sleep(tokens * float(FAILPOINTS["token_sleep_ms"]) / 1000.0)


def maybe_raise(thread: str, job_ids: Iterable[str]) -> None:
    if not FAILPOINTS:
        return
    marker = FAILPOINTS.get(f"raise_in_{thread}")
    if marker:
        for job_id in job_ids:
            if marker in job_id:
                raise InjectedFault(f"failpoint raise_in_{thread} hit by job {job_id}")
