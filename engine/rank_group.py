"""The driver's side of tensor parallelism: ranks 1..N-1 as child processes, the pipes to
them and the monitor thread that names a dead rank (engine/distributed.py describes the
whole scheme, and holds the process group and a rank's own side)."""
from __future__ import annotations

import atexit
import multiprocessing as mp
import multiprocessing.connection as mpc
import multiprocessing.util  # noqa: F401  (its atexit hook must be registered before ours)
import os
import signal
import threading
import time
import traceback
import weakref
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from pagedq.engine.distributed import (
    FAILURE_GRACE_S,
    ONE_GROUP,
    STOP_WAIT_S,
    TensorParallelError,
    collective_timeout_s,
    cpu_threads,
    init_group,
    leave_group,
    nvls_off,
    rank_main,
)
from pagedq.engine.parallel import TensorParallel

if TYPE_CHECKING:
    from pagedq.engine.config import EngineConfig


_live_groups: weakref.WeakSet[RankGroup] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """Stop every group's ranks at interpreter exit (runs before multiprocessing's own
    hook, which would SIGTERM and join them: ranks ignore SIGTERM)."""
    for g in list(_live_groups):
        g.close()


class RankGroup:
    """Ranks 1..size-1 as child processes, their pipes, and the monitor thread. Each rank
    builds ``runner_cls(model, config, rank=r, link=DriverLink)`` (the ModelRunner class,
    passed in: this module does not import the runner)."""

    def __init__(self, runner_cls: type, model: str, config: EngineConfig,
                 device: torch.device) -> None:
        if dist.is_initialized():
            raise RuntimeError(ONE_GROUP)
        nvls_off()
        self.size = config.tensor_parallel_size
        self.device = device
        self.failure: TensorParallelError | None = None
        # callable(TensorParallelError): from the monitor thread, or from the engine's thread
        # when its step met the failure first (failure_behind)
        self.on_failure = None
        # () -> None, run before the driver leaves the process group (it destroys the
        # driver's CUDA graphs); it must not hold the runner, which owns this group
        self.before_leave: Any = None
        self._lock = threading.Lock()
        # one reaper at a time: two threads in waitpid() on one rank, one of them gets
        # ECHILD and saw no exit code (a killed rank was once reported as still running)
        self._reap_lock = threading.Lock()
        self._ended: dict[int, TensorParallelError] = {}  # rank -> how it ended (once)
        self._closed = False
        self._serving = False  # every rank passed "ready": it reads its pipe, "stop" works
        self._owns_group = False
        self._threads = None
        ctx = mp.get_context("spawn")
        # the store's listening socket is bound before any rank starts: no port race
        self.store = dist.TCPStore("127.0.0.1", 0, self.size, True,
                                   timedelta(seconds=collective_timeout_s()),
                                   wait_for_workers=False)
        self.procs: list[mp.process.BaseProcess] = []
        self.conns: list[mpc.Connection] = []  # duplex: commands down, barrier tags up
        self.errs: list[mpc.Connection] = []  # read-only: a rank's last words
        self._wake_r, self._wake_w = ctx.Pipe(duplex=False)  # close() wakes the monitor
        cfg = config  # pickled whole: a rank validates nothing again
        try:
            for r in range(1, self.size):
                conn, child = ctx.Pipe()
                err_r, err_w = ctx.Pipe(duplex=False)
                p = ctx.Process(target=rank_main, name=f"pagedq-tp-rank-{r}", daemon=True,
                                args=(runner_cls, r, self.size, self.store.port, model, cfg,
                                      child, err_w, os.getpid()))
                p.start()
                child.close()
                err_w.close()
                self.procs.append(p)
                self.conns.append(conn)
                self.errs.append(err_r)
        except BaseException:
            self.close()
            raise
        _live_groups.add(self)
        threading.Thread(target=self._watch, name="pagedq-tp-monitor", daemon=True).start()
        if device.type == "cpu":  # the ranks share the cores: no oversubscription
            self._threads = torch.get_num_threads()
            torch.set_num_threads(cpu_threads(self.size))

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    # ---- set-up ----------------------------------------------------------------------
    def init_group(self, device: torch.device) -> TensorParallel:
        self.barrier("started")  # every rank imported torch and is about to join
        try:
            tp = init_group(self.store, 0, self.size, device)
        except Exception as e:
            if (failure := self.failure_behind(e)) is not None:
                raise failure from e
            raise
        self._owns_group = True
        return tp

    def barrier(self, tag: str) -> None:
        """Wait until every rank has reached ``tag``, then release them all. A rank that
        dies or fails meanwhile -> TensorParallelError."""
        for r, conn in enumerate(self.conns, 1):
            got = self._recv(r, conn)
            if got != tag:
                raise TensorParallelError(f"tensor-parallel rank {r} sent {got!r}, "
                                          f"expected {tag!r}")
        self.send("go")
        self._serving = tag == "ready"

    def _recv(self, r: int, conn: mpc.Connection) -> Any:
        proc = self.procs[r - 1]
        while True:
            if self.failure is not None:
                raise self.failure
            ready = mpc.wait([conn, proc.sentinel], timeout=1.0)
            if conn in ready:
                try:
                    return conn.recv()
                except (EOFError, OSError):
                    pass  # it died: the sentinel says how
            if proc.sentinel in ready or conn in ready:
                raise self._fail(self._describe(r))

    # ---- steps -----------------------------------------------------------------------
    def send(self, msg: Any) -> None:
        """``msg`` down every rank's pipe (a dead rank: its TensorParallelError)."""
        if self.failure is not None:
            raise self.failure
        try:
            for conn in self.conns:
                conn.send(msg)
        except (OSError, ValueError) as e:  # a broken pipe: a rank is gone
            raise (self.failure_behind(e) or TensorParallelError(
                f"lost the pipe to a tensor-parallel rank ({e})")) from e

    def check(self) -> None:
        if self.failure is not None:
            raise self.failure

    def failure_behind(self, exc: BaseException) -> TensorParallelError | None:
        """The rank failure that explains ``exc``, or None: then ``exc`` is the driver's
        own error. A failed collective or pipe: a peer that died broke it as its process
        ended, so this waits up to FAILURE_GRACE_S for a rank's process to end (asking the
        processes, not the monitor thread, which a loaded machine may not have run yet).
        None means every rank is still running: never a guess from a timeout."""
        if isinstance(exc, TensorParallelError):
            return exc
        if self.failure is None and not self._closed:
            ended = mpc.wait([p.sentinel for p in self.procs], FAILURE_GRACE_S)
            if ended:
                r = 1 + [p.sentinel for p in self.procs].index(ended[0])
                self._fail(self._describe(r))
        return self.failure

    # ---- failure ---------------------------------------------------------------------
    def _watch(self) -> None:
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs, 1)}
        try:
            ready = mpc.wait([*sentinels, self._wake_r])
        except OSError:  # closed under us
            return
        dead = [sentinels[s] for s in ready if s in sentinels]
        if dead and not self._closed:
            self._fail(self._describe(dead[0]))

    def _describe(self, r: int) -> TensorParallelError:
        """How rank r ended, asked once its pipe closed or its process ended (the monitor
        and a waiting thread may both ask: one reaps, both get the same answer)."""
        with self._reap_lock:
            if r not in self._ended:
                self._ended[r] = self._how_it_ended(r)
            return self._ended[r]

    def _how_it_ended(self, r: int) -> TensorParallelError:
        proc = self.procs[r - 1]
        proc.join(STOP_WAIT_S)  # it is gone, or going: its pipe or its sentinel said so
        code = proc.exitcode
        if code is None:  # the pipe closed under a process still running (not seen yet)
            how = "closed its pipe to the driver while still running"
        elif code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        else:
            how = f"exited with code {code}"
        said = ""
        err = self.errs[r - 1]
        try:
            if err.poll(0.5):
                said = f" ({' '.join(str(err.recv()).split())[:500]})"
        except (EOFError, OSError):
            pass
        return TensorParallelError(f"tensor-parallel rank {r} of {self.size} (pid {proc.pid}) "
                                   f"{how}{said}: the engine cannot continue")

    def _fail(self, exc: TensorParallelError) -> TensorParallelError:
        """Record the group's failure (the first one wins; none after close) and return it;
        the first time, unblock collectives, then tell ``on_failure`` (a handler that closes
        the engine must not wait on a step stuck in a collective)."""
        with self._lock:
            if self.failure is not None or self._closed:
                return self.failure or exc
            self.failure = exc
        if self.device.type == "cuda" and self._owns_group and dist.is_initialized():
            try:  # unblock a driver waiting on a collective with the dead peer
                dist.distributed_c10d._abort_process_group()
            except Exception:  # noqa: BLE001
                pass
        callback = self.on_failure
        if callback is not None:
            try:
                callback(exc)
            except Exception:  # noqa: BLE001 - the failure is recorded either way
                traceback.print_exc()
        return exc

    def close(self) -> None:
        """Stop the ranks (a clean "stop", SIGKILL after STOP_WAIT_S) and leave the process
        group. Idempotent; safe after a failure."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        _live_groups.discard(self)
        try:
            self._wake_w.send(b"")
        except (OSError, ValueError):
            pass
        for conn in self.conns:
            try:
                conn.send(("stop",))
            except (OSError, ValueError):
                pass
        if self._owns_group and dist.is_initialized():
            if self.before_leave is not None:
                try:
                    self.before_leave()
                except Exception:  # noqa: BLE001 - a failed device: abort below anyway
                    pass
            leave_group(abort=self.failure is not None and self.device.type == "cuda")
        # a rank still building (or a group that failed) is not reading its pipe: no wait
        deadline = time.monotonic() + (STOP_WAIT_S if self._serving and not self.failure else 0)
        for p in self.procs:
            with self._reap_lock:
                p.join(max(0.0, deadline - time.monotonic()))
                if p.is_alive():
                    p.kill()
                    p.join(STOP_WAIT_S)
        for c in (*self.conns, *self.errs, self._wake_r, self._wake_w):
            c.close()
        if self._threads is not None:
            torch.set_num_threads(self._threads)
        self.store = None
