"""How a worker reads new jobs (a part of intake, worker/intake.py).

SUBMIT puts a job on its lane's inbox, a list producers can only append to; every read of
new entries first moves jobs from the inboxes into the jobs streams (MOVE), then reads them
with XREADGROUP, in the same round trip (``move_and_read``). An idle worker that found
nothing waits on its model's wake lists (BLPOP: one item per SUBMIT), then reads once more
(``idle_read``).

No command names keys of two key spaces on a Redis Cluster (two slots): an idle worker there
reads every key space without blocking (one pipeline), and only when all are empty waits on
one key space's wake list, for CLUSTER_IDLE_BLOCK_MS, the key space rotating, so a job in
another partition waits that long at most.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagedq.wire import script
from pagedq.wire.keys import GROUP, Keys
from pagedq.wire.worker_scripts import NAMES as WORKER_SCRIPTS
from pagedq.wire.worker_scripts import Move

# each read moves up to this many jobs of an inbox into its stream, however few it reads:
# the stream then holds (nearly) every unfinished job of its lane while any worker runs,
# what an autoscaler reads (XLEN, the group's lag: docs/deployment.md "Autoscaling"); a job
# moves once, and an empty inbox costs one LPOP
MOVE_MAX = 256
IDLE_BLOCK_MS = 500  # an idle worker's wait on the wake lists, between two reads
CLUSTER_IDLE_BLOCK_MS = 100  # on a cluster: one key space's wait, between full sweeps


def run_pipeline(r: Any, fill: Callable[[Any], None]) -> list:
    """The commands ``fill(pipe)`` queues, in one round trip (the scripts loaded and the
    round sent again if Redis lost them); raises a refused command's error (a full Redis:
    StorageFull; a missing group: NOGROUP) or an outage's."""
    for _ in range(2):
        pipe = r.pipeline(transaction=False)
        fill(pipe)
        res = pipe.execute(raise_on_error=False)
        if not script.noscript(res):
            break
        script.load(r, WORKER_SCRIPTS)
    script.raise_retryable(res)
    for x in res:
        if isinstance(x, Exception):
            raise script.storage_full(x) if script.is_oom(x) else x
    return res


def flat(replies: list) -> list:
    """Several XREADGROUP replies as one: [[stream, entries], ...]."""
    return [x for reply in replies for x in reply or []]


class NewEntries:
    """``ident``: the worker's WorkerIdentity; ``on_stream_made(stream)``: called when MOVE
    had to make a jobs stream (and its group) again: it had vanished."""

    def __init__(self, ident: Any, on_stream_made: Callable[[str], None]) -> None:
        self.ident, self.r = ident, ident.r
        self.model, self.worker_id = ident.model, ident.worker_id
        self.on_stream_made = on_stream_made
        self.moves = 0  # MOVE rounds Redis took (it was not full for them)

    def move_and_read(self, pairs: list[tuple[str, Keys, int]]) -> list:
        """For each (lane, key space, n): MOVE jobs from the inbox into the stream
        (MOVE_MAX at most), then read up to n new entries, in one round trip; the reads'
        replies (XREADGROUP's shape), one per key space and count (its COUNT is per call)."""
        reads: dict[tuple[Keys, int], list[str]] = {}
        for lane, k, n in pairs:
            reads.setdefault((k, n), []).append(self.ident.stream(lane, k))

        def fill(pipe: Any) -> None:
            for lane, k, n in pairs:
                script.queue(pipe, Move(k, self.model, lane, max(n, MOVE_MAX)))
            for (_k, n), streams in reads.items():
                pipe.xreadgroup(GROUP, self.worker_id, dict.fromkeys(streams, ">"), count=n)

        res = run_pipeline(self.r, fill)
        self.moves += 1
        for (lane, k, _n), moved in zip(pairs, res, strict=False):
            if int(moved[1]):
                self.on_stream_made(self.ident.stream(lane, k))
        return res[len(pairs):]

    def idle_read(self, order: list[Keys], lanes: list[str]) -> tuple[list, int]:
        """An idle worker's read: one entry of each of ``lanes``' streams of every key space
        (``order``: the tenants' key spaces, the first waited on); (XREADGROUP's reply
        shape, round trips made)."""
        if self.ident.cluster:
            pairs = [(ln, k, 1) for k in order for ln in lanes]
            waits, wait_ms = [order[0]], CLUSTER_IDLE_BLOCK_MS if len(order) > 1 else IDLE_BLOCK_MS
            again = [(ln, order[0], 1) for ln in lanes]
        else:
            pairs = again = [(ln, k, 1) for ln in lanes for k in order]
            waits, wait_ms = order, IDLE_BLOCK_MS
        resp = flat(self.move_and_read(pairs))
        if resp:
            return resp, 1
        if not self.r.blpop([k.wake(self.model) for k in waits], timeout=wait_ms / 1000):
            return [], 2
        return flat(self.move_and_read(again)), 3
