"""Failpoints for fault-injection tests (off unless PAGEDQ_FAILPOINTS is set).

PAGEDQ_FAILPOINTS="crash_on_prompt=POISON,step_sleep_s=0.2,wedge_on_prompt=HANG"
  crash_on_prompt  : the process dies (os._exit, like a segfault) when it admits a job
                     whose prompt contains the marker
  wedge_on_prompt  : the next engine step hangs forever once such a job is admitted
  step_sleep_s     : every engine step takes this much longer (slow GPU)
"""
from __future__ import annotations

import os
import time


def _parse(spec: str) -> dict[str, str]:
    out = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        k, _, v = part.partition("=")
        out[k] = v
    return out


FAILPOINTS = _parse(os.environ.get("PAGEDQ_FAILPOINTS", ""))
_wedge = False


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


def on_step() -> None:
    if not FAILPOINTS:
        return
    while _wedge:  # a hung kernel / driver call
        time.sleep(3600)
    if "step_sleep_s" in FAILPOINTS:
        time.sleep(float(FAILPOINTS["step_sleep_s"]))
