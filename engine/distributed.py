"""Tensor parallelism over processes: one process per rank (one per GPU), as vLLM runs it.

The driver (the process of the LLMEngine: scheduler, block manager, sampler, and, in a
worker, the only process that talks to Redis) is rank 0. It spawns ranks 1..N-1
(multiprocessing "spawn"), and every rank builds the same ModelRunner holding its shard
(engine/parallel.py), in lockstep: started -> process group -> weights -> barrier
"loaded" -> KV-cache size (all-reduce MIN) -> allocate -> CUDA graphs (their collectives
captured: every rank captures the same sizes in the same order) -> barrier "ready".
The driver's side (RankGroup: the rank processes, their pipes, the monitor thread) is
engine/rank_group.py; this module holds the process group and a rank's own side.
Then each step the driver packs the step's inputs (engine/inputs.py) and sends them down
each rank's pipe; all ranks run the forward pass (all-reduces over NCCL on GPUs, gloo on
the CPU), rank 0 gathers the logits and samples. Ranks never answer a step.

Failure, never a hang, and dead is told from slow by the process, never by a clock:
  * a rank that ends (killed, crashed, OOM) -> the driver's monitor thread records a
    TensorParallelError naming the rank and how it ended (with the rank's own error
    message when it had one) and calls ``on_failure`` (the worker: exit 71, jobs handed
    over through their leases); every later step raises it; a step blocked in a collective
    with the dead peer fails at once (gloo: connection closed; NCCL: the monitor aborts the
    process group);
  * a rank is dead only once its process has ended (its sentinel, its exit code, reaped
    by one thread at a time); a slow or wedged but living peer is waited for: set-up
    barriers have no deadline (loading may take minutes; a death still ends them at
    once), collectives time out after ``collective_timeout_s()``;
  * the driver ending (even SIGKILL) -> each rank sees its pipe close, or its parent pid
    change, and exits: ranks never outlive the driver. Ranks ignore SIGINT and SIGTERM (a
    Ctrl-C or a stop signal sent to the whole process group is the driver's to handle: it
    drains, then stops its ranks).
NVLink multicast stays off: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and
NVSHMEM_DISABLE_NVLS=1 are set for the driver and its ranks when unset (never overridden).
"""
from __future__ import annotations

import multiprocessing.connection as mpc
import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pagedq.engine.parallel import TensorParallel

NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}
TIMEOUT_ENV = "PAGEDQ_TP_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0
FAILURE_GRACE_S = 3.0  # a failed collective waits this long for a rank's process to end
STOP_WAIT_S = 10.0  # close(): how long ranks get to exit before SIGKILL
LEAVE_WAIT_S = 10.0  # leave_group(): how long a clean destroy may take before an abort


ONE_GROUP = ("a torch.distributed process group already exists in this process (one "
             "tensor-parallel engine per process: close() the other one first)")


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died or a collective failed: the engine cannot continue."""


def collective_timeout_s() -> float:
    """Seconds a collective (and the process-group rendezvous) may wait for a peer."""
    raw = os.environ.get(TIMEOUT_ENV, "")
    try:
        value = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV} must be a number of seconds (got {raw!r})") from None
    if value <= 0:
        raise ValueError(f"{TIMEOUT_ENV} must be > 0 (got {raw!r})")
    return value


def nvls_off() -> None:
    for k, v in NVLS_OFF.items():
        os.environ.setdefault(k, v)


def init_group(store: Any, rank: int, size: int, device: torch.device) -> TensorParallel:
    """Join the process group (NCCL on CUDA, gloo on the CPU); this rank's TensorParallel."""
    timeout = timedelta(seconds=collective_timeout_s())
    if dist.is_initialized():
        raise RuntimeError(ONE_GROUP)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=size, timeout=timeout,
                                device_id=device)
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=timeout)
    return TensorParallel(rank, size, dist.group.WORLD)


def cpu_threads(size: int) -> int:
    """torch threads per rank when ranks share the CPU."""
    return max(1, (os.cpu_count() or 1) // size)


def leave_group(abort: bool = False) -> bool:
    """Tear the process group down, bounded: NCCL's destroy finalises the communicators
    with their peers (each rank leaves on "stop", the driver too), and should that not end
    within LEAVE_WAIT_S (a peer gone or wedged) the group is aborted, again bounded. True
    when the group is gone; False leaves a stuck daemon thread behind, never a hang."""
    def attempt(fn: Any) -> bool:
        def call() -> None:
            try:
                fn()
            except Exception:  # noqa: BLE001 - leaving anyway
                pass
        t = threading.Thread(target=call, name="pagedq-tp-leave", daemon=True)
        t.start()
        t.join(LEAVE_WAIT_S)
        return not t.is_alive()
    if not abort and attempt(dist.destroy_process_group):
        return True
    return attempt(dist.distributed_c10d._abort_process_group)


# ---- a rank's side ---------------------------------------------------------------------

class DriverLink:
    """A rank's end of the pipe to the driver (the counterpart of RankGroup)."""

    def __init__(self, conn: mpc.Connection, port: int, size: int, rank: int) -> None:
        self.conn, self.port, self.size, self.rank = conn, port, size, rank

    def init_group(self, device: torch.device) -> TensorParallel:
        self.barrier("started")
        store = dist.TCPStore("127.0.0.1", self.port, self.size, False,
                              timedelta(seconds=collective_timeout_s()))
        return init_group(store, self.rank, self.size, device)

    def barrier(self, tag: str) -> None:
        self.conn.send(tag)
        if self.recv() != "go":
            raise TensorParallelError(f"rank {self.rank}: the driver did not release {tag!r}")

    def recv(self) -> Any:
        """The driver's next message; ("stop",) once the driver is gone."""
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            return ("stop",)


def _exit_with_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(0)
        time.sleep(0.5)


def rank_main(runner_cls: type, rank: int, size: int, port: int, model: str, config: Any,
              conn: mpc.Connection, err: mpc.Connection, parent_pid: int) -> None:
    """Body of rank ``rank``'s process: build the ModelRunner shard in lockstep with the
    driver, then run every step the driver sends until ("stop",) or the driver is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    code = 0
    try:
        cfg = config  # the driver's EngineConfig, validated there
        if cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available()):
            torch.set_num_threads(cpu_threads(size))
        link = DriverLink(conn, port, size, rank)
        runner = runner_cls(model, cfg, rank=rank, link=link)
        serve(runner, link)
    except BaseException as e:  # noqa: BLE001 - reported to the driver, then exit
        code = 1
        traceback.print_exc()
        try:
            err.send(f"{type(e).__name__}: {e}")
        except (OSError, ValueError):
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    # no interpreter teardown: process-group destructors could wait on the gone driver
    os._exit(code)


def serve(runner: Any, link: DriverLink) -> None:
    """Run the driver's steps (``runner.run_packed``) until it stops or is gone."""
    while True:
        msg = link.recv()
        if msg[0] == "step":
            runner.run_packed(msg[1])
        elif msg[0] == "stop":  # leave the group with the driver (bounded), then exit
            if dist.is_initialized():
                runner.release_graphs()
                leave_group()
            return
        else:
            raise TensorParallelError(f"rank {link.rank}: unknown command {msg[0]!r}")
