"""Run real `pagedq worker` processes for tests (killable with real signals)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import redis

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A worker of any model but SmolLM2 serves a tiny test model (< 1 KiB of KV per token, 256
# context): 32 MiB of KV cache holds 64 seqs x 256 tokens twice over. The 1 GiB default
# costs each start about a second of page faults and each live worker 1 GiB of memory.
# SmolLM2 workers keep the default (it sizes their context); env= or os.environ win.
TINY_KV_CACHE_GB = "0.03125"


class WorkerProc:
    def __init__(self, redis_url: str, prefix: str, *, model: str = "smollm2",
                 worker_id: str | None = None, extra: list[str] | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.redis_url, self.prefix, self.model = redis_url, prefix, model
        self.worker_id = worker_id or f"w-{os.urandom(3).hex()}"
        self.extra = extra or []
        self.env = env or {}
        self.proc: subprocess.Popen | None = None
        self.log_path = tempfile.mktemp(prefix=f"pagedq-{self.worker_id}-", suffix=".log")

    def start(self, wait: bool = True, timeout: float = 180.0) -> WorkerProc:
        cmd = [sys.executable, "-m", "pagedq", "--redis-url", self.redis_url,
               "--prefix", self.prefix, "worker", "--model", self.model,
               "--worker-id", self.worker_id, *self.extra]
        small_kv = {} if self.model == "smollm2" else {"PAGEDQ_KV_CACHE_MEMORY_GB":
                                                       TINY_KV_CACHE_GB}
        env = {**small_kv, **os.environ, "PYTHONPATH": ROOT, **self.env}
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     cwd=ROOT)
        if wait:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 180.0) -> None:
        """Ready = its heartbeat key exists (written from the engine loop)."""
        if self.env.get("PAGEDQ_REDIS_CLUSTER"):  # a node answers MOVED for others' slots
            from redis.cluster import RedisCluster
            r = RedisCluster.from_url(self.redis_url, decode_responses=True)
        else:
            r = redis.Redis.from_url(self.redis_url, decode_responses=True)
        key = "{" + self.prefix + "}:worker:" + self.worker_id
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited ({self.proc.returncode}):\n{self.log()}")
            if r.exists(key):
                return
            time.sleep(0.1)
        raise TimeoutError(f"worker not ready in {timeout}s:\n{self.log()}")

    def log(self, tail: int | None = 5000) -> str:
        with open(self.log_path, errors="replace") as f:
            text = f.read()
        return text[-tail:] if tail else text

    def signal(self, sig: int) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        if self.proc:
            self.proc.wait(30)

    def stop(self, timeout: float = 60.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode
