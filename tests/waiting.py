"""Waiting on a condition with a deadline (tests never sleep a fixed time)."""
from __future__ import annotations

import time


def until(cond, what: str, timeout: float = 60.0, every: float = 0.02):
    """``cond()``'s first truthy value; AssertionError naming ``what`` after ``timeout`` s."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = cond()
        if v:
            return v
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")
