"""A Redis server and one worker process serving a bench/offline.py shape (random weights),
as bench/service.py's closed and open-loop modes run them."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from offline import model_folder

from pagedq.worker.redis_server import RedisServer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "bench"  # the served name and the clients' model
PREFIX = "bench"


class Served:
    """``with Served(shape, env) as s:`` s.url serves MODEL under PREFIX; after the block,
    s.stats holds the worker's ``worker_stopped`` log line (steps, round trips, loop_s)."""

    def __init__(self, shape: str, env: dict[str, str]) -> None:
        self.shape, self.env = shape, env
        self.stats: dict = {}

    def __enter__(self) -> Served:
        self.srv = RedisServer().__enter__()
        self.url = self.srv.url
        self.log_path = os.path.join(self.srv.dir, "worker.log")
        cmd = [sys.executable, "-m", "pagedq", "--redis-url", self.url, "--prefix", PREFIX,
               "worker", "--model", model_folder(self.shape), "--served-name", MODEL,
               "--load-format", "dummy", "--max-num-seqs", "256", "--max-model-len", "4096",
               "--max-num-batched-tokens", "16384", "--worker-id", "bench"]
        try:
            with open(self.log_path, "w") as logf:
                self.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT,
                                             env=self.env, cwd=ROOT)
        except BaseException:
            self.srv.__exit__(None, None, None)
            raise
        import redis
        self.redis = redis.Redis.from_url(self.url)
        return self

    def redis_cpu(self) -> float:
        """CPU seconds redis-server has used so far (user + sys)."""
        info = self.redis.info("cpu")
        return info["used_cpu_user"] + info["used_cpu_sys"]

    def __exit__(self, *exc: object) -> None:
        try:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(120)
            with open(self.log_path) as f:
                lines = [x for x in f if '"worker_stopped"' in x]
            self.stats = json.loads(lines[-1]) if lines else {}
        finally:
            self.redis.close()
            self.srv.__exit__(*exc)
