"""The worker's garbage collector: the heap of start-up frozen, full collections timed.

After start-up the process holds ~330k objects the collector tracks (torch, transformers,
the model, the tokenizer), none of them ever garbage. A full collection scans them all:
~180 ms on a 2-core CPU (a CPython 3.11 process with SmolLM2 loaded), a stall of the
engine thread, so of every running job's tokens and of the first token of every job
arriving meanwhile. ``gc.freeze()`` moves them to the permanent generation: full
collections then scan only what the worker allocated since, mostly the running jobs'
state, whose token ids and text are kept out of the scan too (engine/sequence.py).
"""
from __future__ import annotations

import gc
import time


class GcPauses:
    """Freezes the heap (``start``) and counts the full (oldest-generation) collections
    that follow, with their longest and total pause (the worker's exit line)."""

    def __init__(self) -> None:
        self.full = 0
        self.max_s = self.total_s = 0.0
        self._t0 = 0.0

    def start(self) -> None:
        gc.freeze()
        gc.callbacks.append(self._callback)

    def stop(self) -> None:
        """At the worker's exit (also in a test's process: the heap is unfrozen)."""
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
        gc.unfreeze()

    def _callback(self, phase: str, info: dict) -> None:
        # runs in whichever thread triggered the collection, holding the GIL
        if info["generation"] != 2:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        pause = time.perf_counter() - self._t0
        self.full += 1
        self.total_s += pause
        self.max_s = max(self.max_s, pause)
