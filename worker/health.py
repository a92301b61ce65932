"""What a worker's /healthz and /readyz answer (served by worker/http_server.py).

The engine loop (worker/service.py ``Worker._loop``) calls ``beat()`` once per iteration.
An iteration lasts one engine step (kept near PAGEDQ_MAX_STEP_S by the pacer) plus one
intake poll (an idle worker blocks at most 0.5 s on its streams), so a loop that has not
beaten for ``max_silence_s`` is stuck: a wedged step (a hung kernel or driver call), a
Redis call hanging past its socket timeout, a deadlock. The step watchdog ends such a
process after PAGEDQ_STEP_WATCHDOG_S; the health endpoint says so sooner, and says why.

Liveness (/healthz) and readiness (/readyz) differ only while the worker starts or drains:

  phase      /healthz  /readyz
  starting     503       503    metrics server up, engine loop not started yet
  serving      200       200    (503 "wedged" on both when the loop is silent too long)
  draining     200       503    SIGTERM: no new jobs, running ones finish
  stopped      503       503    the loop has ended

A draining worker stays live on purpose: an orchestrator that restarts unlive processes
would otherwise kill it mid-drain and lose what the drain was for.

Degraded: a serving worker whose writes Redis refuses for memory (a full Redis) keeps its
jobs and retries (worker/publisher.py, worker/service.py); while any part of it reports so
(``degrade``), /healthz answers 200 and /readyz 503, both with status ``degraded`` and the
reason: a restart would not help, and no more work should be sent its way.

Only plain attribute reads and writes cross threads here (the engine thread writes, the
HTTP threads read): no lock, and a health request never waits on the engine.
"""
from __future__ import annotations

import time

STARTING, SERVING, DRAINING, STOPPED = "starting", "serving", "draining", "stopped"


class Health:
    def __init__(self, max_silence_s: float, worker_id: str = "") -> None:
        self.max_silence_s = max_silence_s
        self.worker_id = worker_id
        self.phase = STARTING
        self.last_beat: float | None = None  # time.monotonic() of the loop's last iteration
        self.degraded: dict[str, str] = {}  # part of the worker -> why (set from any thread)

    def beat(self) -> None:
        self.last_beat = time.monotonic()

    def set_phase(self, phase: str) -> None:
        self.phase = phase

    def degrade(self, part: str, reason: str) -> bool:
        """``part`` of the worker works, but not fully (``reason``); True if it was not
        degraded yet."""
        new = part not in self.degraded
        self.degraded[part] = reason
        return new

    def recover(self, part: str) -> bool:
        """``part`` works fully again; True if it was degraded."""
        return self.degraded.pop(part, None) is not None

    def check(self, ready: bool = False) -> tuple[int, dict]:
        """(HTTP status, JSON body) of /readyz (``ready``) or /healthz."""
        body: dict = {"worker_id": self.worker_id, "phase": self.phase,
                      "max_silence_s": self.max_silence_s}
        last = self.last_beat
        silent = None if last is None else time.monotonic() - last
        if silent is not None:
            body["loop_silent_s"] = round(silent, 3)
        if self.phase == STARTING or last is None:
            return 503, {**body, "status": "starting",
                         "reason": "the engine loop has not started yet"}
        if self.phase == STOPPED:
            return 503, {**body, "status": "stopped", "reason": "the engine loop has ended"}
        if silent > self.max_silence_s:
            return 503, {**body, "status": "wedged",
                         "reason": f"the engine loop has not run for {silent:.1f} s "
                                   f"(bound {self.max_silence_s:g} s): a step or a Redis call "
                                   f"is stuck"}
        if self.phase == DRAINING and ready:
            return 503, {**body, "status": "draining",
                         "reason": "stopping: takes no new jobs, finishes running ones"}
        if degraded := dict(self.degraded):
            reason = "; ".join(sorted(set(degraded.values())))
            return 503 if ready else 200, {**body, "status": "degraded", "reason": reason}
        return 200, {**body, "status": "ok"}
