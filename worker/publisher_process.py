"""The publisher in a process of its own, so that its Python never holds the engine
thread's interpreter lock.

A publisher thread in the worker's process competes with the engine thread for the GIL:
each time the engine thread comes back from waiting on the device or on a Redis reply, it
waits for the publisher to let go (up to the switch interval, 1 ms) while the publisher
builds a round (about 0.8 ms of Python per step of 256 jobs: docs/benchmarks.md,
"Service"). ``PublisherProcess`` has the interface of ``worker.publisher.Publisher`` and
runs one in a spawned child: the engine thread only pickles each call onto a pipe (about
50-100 us per step of 256 jobs); the child's main thread puts what it reads on its
publisher's queue, in order, and the publisher's thread sends back what the worker must
act on (cancels, fenced-off jobs, final verdicts, flushes) on a second pipe, read here by
a thread that runs the callbacks and fills the same queues as the in-process publisher.

Invariants: every call reaches the child in the order it was made (one lock over the
pipe, whichever thread calls); what ``call`` and ``final`` carry must pickle (no closures:
liveness.BeatWrite is the heartbeat's). Neither side outlives the other half-alive: the
child exits when the worker's end of the pipe closes (the worker died, or stopped), and
the worker dies (exit 71, worker/fatal.py) when the child ends without being told to; a
fault in the child's publisher thread is logged there as ``worker_fault`` (thread
"publisher") and ends the child, hence the worker.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import multiprocessing
import os
import queue
import signal
import threading
from collections.abc import Callable

import redis

from producer.settings import Settings
from worker import fatal

# the worker's calls that stop the child (its last message) / what the child sends back
_STOP = ("stop",)


class PublisherProcess:
    """worker.publisher.Publisher's interface (register, tokens, final, call,
    check_cancels, flush, stop; cancel_hits, lost, rounds, errors, cpu_s), in a child
    process. Calls made before ``start`` are kept and sent first."""

    def __init__(self, r: redis.Redis, settings: Settings) -> None:
        del r  # the child connects with the settings (a client does not cross processes)
        self.s = settings
        self.cancel_hits: queue.SimpleQueue = queue.SimpleQueue()
        self.lost: queue.SimpleQueue = queue.SimpleQueue()
        self.rounds = self.errors = 0
        self.cpu_s = 0.0
        self._lock = threading.Lock()
        self._early: list[tuple] | None = []  # calls before start()
        self._ids = itertools.count()
        self._on_done: dict[int, Callable[[str], None]] = {}
        self._flushed: dict[int, threading.Event] = {}
        self._stats = threading.Event()
        self._stopping = False
        self._proc = None
        self._to_child = self._from_child = None

    def start(self) -> PublisherProcess:
        ctx = multiprocessing.get_context("spawn")  # not fork: the engine's threads, CUDA
        child_in, self._to_child = ctx.Pipe(duplex=False)
        self._from_child, child_out = ctx.Pipe(duplex=False)
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        self._proc = ctx.Process(target=_child_main, name="pagedq-publisher", daemon=True,
                                 args=(self.s, level, child_in, child_out))
        self._proc.start()
        child_in.close()  # the child's ends: closed here, so each side sees the other's EOF
        child_out.close()
        threading.Thread(target=fatal.guarded("publisher", self._receive),
                         name="pagedq-publisher-replies", daemon=True).start()
        with self._lock:
            early, self._early = self._early, None
            for msg in early:
                self._to_child.send(msg)
        return self

    # ---- the Publisher interface --------------------------------------------------------
    def register(self, keys, job_id: str, attempt: int, next_index: int) -> None:
        self._send(("reg", keys, job_id, attempt, next_index))

    def tokens(self, batch: list, urgent: bool = False) -> None:
        if batch:
            self._send(("tok", batch, urgent))

    def final(self, f) -> None:
        fid = None
        if f.on_done is not None:
            fid = next(self._ids)
            self._on_done[fid] = f.on_done
            f = dataclasses.replace(f, on_done=None)
        self._send(("fin", f, fid))

    def call(self, fn: Callable) -> None:
        self._send(("call", fn))

    def check_cancels(self, uids: list[str]) -> None:
        if uids:
            self._send(("cancel?", uids))

    def flush(self, timeout: float = 30.0) -> bool:
        ev = threading.Event()
        fid = next(self._ids)
        self._flushed[fid] = ev
        self._send(("flush", fid))
        return ev.wait(timeout) if self._proc is not None else False

    def stop(self, timeout: float = 30.0) -> None:
        if self._proc is None:
            return
        self.flush(timeout)
        self._stopping = True
        self._send(_STOP)
        self._stats.wait(timeout)
        self._proc.join(timeout)

    # ---- plumbing ---------------------------------------------------------------------
    def _send(self, msg: tuple) -> None:
        with self._lock:
            if self._early is not None:
                self._early.append(msg)
            else:
                self._to_child.send(msg)

    def _receive(self) -> None:
        while True:
            try:
                msg = self._from_child.recv()
            except EOFError:
                if self._stopping:
                    return
                self._proc.join(5)
                raise RuntimeError(f"the publisher process ended (exit code "
                                   f"{self._proc.exitcode})") from None
            kind = msg[0]
            if kind == "done":
                self._on_done.pop(msg[1])(msg[2])
            elif kind == "cancel":
                self.cancel_hits.put(msg[1])
            elif kind == "lost":
                self.lost.put(msg[1])
            elif kind == "flushed":
                self._flushed.pop(msg[1]).set()
            elif kind == "stats":
                self.rounds, self.errors, self.cpu_s = msg[1:]
                self._stats.set()


class _Out:
    """What the child's publisher thread hands back, as ``.put(x)`` (its queues) or
    ``.set()`` (a flush's event): one message on the pipe to the worker."""

    def __init__(self, send: Callable[[tuple], None], kind: str, key=None) -> None:
        self.send, self.kind, self.key = send, kind, key

    def put(self, x) -> None:
        self.send((self.kind, x))

    def set(self) -> None:
        self.send((self.kind, self.key))

    def __call__(self, verdict: str) -> None:  # a final's on_done
        self.send((self.kind, self.key, verdict))


def _child_main(settings: Settings, level: str, conn_in, conn_out) -> None:
    from producer import connection
    from worker import logs, lua
    from worker.publisher import Publisher

    # a signal is the worker's to handle (SIGTERM drains it; Ctrl-C reaches the whole
    # process group): this process ends when the worker stops it or is gone
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logs.configure(level)
    r = connection.connect(settings, decode_responses=True, health_check_interval=10,
                           socket_timeout=30)
    # every worker script is known here, so that a NOSCRIPT reply loads them all (a
    # heartbeat's lease refresh rides on the publisher's pipeline)
    for source in (lua.START, lua.PUBLISH, lua.FINISH, lua.REJECT, lua.REFRESH,
                   lua.EXPIRE_UNSERVED):
        lua.Script(r, source)
    lock = threading.Lock()

    def send(msg: tuple) -> None:
        with lock:
            conn_out.send(msg)

    pub = Publisher(r, settings)
    pub.cancel_hits, pub.lost = _Out(send, "cancel"), _Out(send, "lost")
    pub.start()
    while True:
        try:
            msg = conn_in.recv()
        except EOFError:  # the worker is gone: what it left unsent is fenced by attempt
            os._exit(0)
        kind = msg[0]
        if kind == "fin":  # the worker's callback stays there: its verdict goes back
            f, fid = msg[1], msg[2]
            if fid is not None:
                f.on_done = _Out(send, "done", fid)
            pub.enqueue(("fin", f))
        elif kind == "flush":
            pub.enqueue(("flush", _Out(send, "flushed", msg[1])))
        elif msg == _STOP:
            pub.stop()
            send(("stats", pub.rounds, pub.errors, pub.cpu_s))
            return
        else:
            pub.enqueue(msg)
