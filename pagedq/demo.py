"""`pagedq demo`: Redis (an embedded redis-server unless ``--redis-url`` or
$PAGEDQ_REDIS_URL names one) + a CPU worker process with the bundled SmolLM2 + a handful of chat jobs, streamed back into a live view
(pagedq/demo_view.py; ``--plain`` or a stdout that is not a terminal: plain lines).

The worker's loading stages and start line (worker/startup.py) are read from its log file
as it writes them. The jobs are submitted once the worker is ready, so TTFT measures the
service, not the model load. Greedy (temperature 0): a 135M model samples nonsense at 1.0.

Redis hygiene: the demo never writes into a Redis the user did not name (a Redis that
happens to answer on the default port may be a shared or a production one); the one it
uses is the first line it prints (the live view's header). The demo's keys live under a prefix of its own (``pagedq-demo-<pid>-<hex>``)
and are removed at exit, after the worker has stopped (it writes heartbeats until then),
even on Ctrl-C or a failure; ``--keep`` leaves them for a look. With ``--prefix P`` the
keys are the user's and stay (job records expire after PAGEDQ_RESULT_TTL_S).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from typing import Any

from pagedq.demo_view import DemoJob, DemoState, LiveView, PlainView
from pagedq.worker.startup import parse_line

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give three tips for learning Python.",
    "Explain what a hash table is in two sentences.",
    "Name the planets of the solar system.",
    "What is 17 times 3? Answer briefly.",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue? One sentence.",
]
LOAD_TIMEOUT_S = 900.0  # a first start dequantizes the model: tens of seconds on a laptop
STREAM_TIMEOUT_S = 300.0  # most seconds without a token


def register(sub: argparse._SubParsersAction, parents: Iterable[argparse.ArgumentParser]) -> None:
    """Add `pagedq demo`: the engine options of `pagedq worker`, and its own."""
    from pagedq.worker.cli import add_engine_args

    d = sub.add_parser("demo", help="embedded Redis + CPU worker + a few streamed jobs",
                       description="Redis (an embedded redis-server, unless --redis-url or "
                                   "$PAGEDQ_REDIS_URL names one) + a worker with the bundled "
                                   "SmolLM2 + a few chat jobs, streamed into a live view, then "
                                   "a summary. The demo's Redis keys are removed at exit.",
                       parents=list(parents))
    add_engine_args(d)
    d.add_argument("--jobs", type=int, default=6, help="jobs to submit (default: %(default)s)")
    d.add_argument("--max-tokens", type=int, default=48,
                   help="max_tokens of each job (default: %(default)s)")
    d.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="sampling temperature of each job (default: %(default)s = greedy)")
    d.add_argument("--plain", action="store_true",
                   help="plain lines for logs and CI instead of the live view (default: off; "
                        "on when stdout is not a terminal)")
    d.add_argument("--keep", action="store_true",
                   help="keep the demo's Redis keys and the worker's log (default: off)")
    d.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    from pagedq.worker.cli import check_config, check_model

    check_model(check_config(args))  # the demo's worker would exit 78 into its log; say it here
    return run_demo(args)


class DemoFailed(Exception):
    """The worker exited or did not get ready; the message says why (with its log's tail)."""


def run_demo(args: argparse.Namespace) -> int:
    from pagedq.wire.redis_errors import RedisUnusable, redact_url
    from pagedq.wire.settings import Settings
    from pagedq.worker.config import ConfigError
    from pagedq.worker.embedded import redis_answers
    from pagedq.worker.redis_server import RedisServer

    settings = Settings()
    named = args.redis_url or os.environ.get("PAGEDQ_REDIS_URL")
    server = None
    if named:
        try:
            if not redis_answers(named, settings):
                raise ConfigError(f"no Redis answers at {redact_url(named)} (--redis-url or "
                                  "$PAGEDQ_REDIS_URL); leave both unset for an embedded one")
        except RedisUnusable as e:
            raise ConfigError(str(e)) from None
        url = named
    else:  # never whatever answers on the default port: it may be a shared Redis
        server = RedisServer(die_with_parent=True).start()
        url = server.url
    own_prefix = args.prefix is None
    prefix = args.prefix or f"pagedq-demo-{os.getpid()}-{secrets.token_hex(2)}"
    state = DemoState(redis=redact_url(url) + (" (embedded)" if server else ""), prefix=prefix,
                      log_path=os.path.join(tempfile.gettempdir(),
                                            f"pagedq-demo-worker-{os.getpid()}.log"))
    plain = args.plain or not sys.stdout.isatty()
    view: LiveView | PlainView = PlainView(state, sys.stdout) if plain else LiveView(state)
    if plain:
        view.say(f"redis: {state.redis}; key prefix {prefix}; worker log {state.log_path}")
    proc = _start_worker(args, url, prefix, state.log_path)
    ok = False
    try:
        with view:
            asyncio.run(_run(args, url, prefix, proc, state, view))
        view.summary()
        ok = all(j.status == "finished" for j in state.jobs)
        return 0 if ok else 1
    except DemoFailed as e:
        print(f"pagedq: demo failed: {e}", file=sys.stderr)
        return 1
    finally:
        _stop(proc)
        if own_prefix and not args.keep:
            removed = _remove_keys(url, prefix)
            view.say(f"removed the demo's {removed} Redis keys (prefix {prefix})")
        if server is not None:
            server.cleanup()
        if ok and not args.keep:
            _unlink(state.log_path)


def _start_worker(args: argparse.Namespace, url: str, prefix: str,
                  log_path: str) -> subprocess.Popen:
    from pagedq.worker.config import flag_argv

    # the URL goes by the environment, not argv: a password in it would show in ps
    cmd = [sys.executable, "-m", "pagedq", "--prefix", prefix, "worker",
           "--model", args.model or "smollm2", "--worker-id", "demo-worker",
           *flag_argv(args, skip=frozenset({"redis_url", "prefix", "model", "worker_id"}))]
    with open(log_path, "w") as logf:
        return subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, "PAGEDQ_REDIS_URL": url})


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()  # drains: the demo's jobs have ended or are given up
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _remove_keys(url: str, prefix: str) -> int:
    """Delete every key of the prefix, every partition's (docs/protocol.md: all keys are
    ``{prefix}:...`` or ``{prefix:p<k>}:...``)."""
    import redis

    from pagedq.producer import Client

    try:
        with Client(url, prefix=prefix) as c:
            keys = [k for space in c.keys.spaces(c.settings.partitions)
                    for k in c.redis.scan_iter(match=space.base + ":*", count=1000)]
            for i in range(0, len(keys), 500):
                c.redis.unlink(*keys[i:i + 500])
            return len(keys)
    except redis.RedisError as e:
        print(f"pagedq: could not remove the demo's keys {{{prefix}}}:* ({e})", file=sys.stderr)
        return 0


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _log_tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


async def _run(args: argparse.Namespace, url: str, prefix: str, proc: subprocess.Popen,
               state: DemoState, view: LiveView | PlainView) -> None:
    from pagedq.producer import AsyncClient
    from pagedq.worker.names import served_name

    state.model = served_name(args.model or "smollm2", args.served_name)
    watcher = asyncio.create_task(_watch_worker(proc, state, view))
    try:
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while not state.ready:
            if watcher.done():
                watcher.result()  # raises DemoFailed
            if time.monotonic() > deadline:
                raise DemoFailed(f"the worker was not ready after {LOAD_TIMEOUT_S:.0f} s "
                                 f"(log: {state.log_path})")
            await asyncio.sleep(0.05)
        async with AsyncClient(url, prefix=prefix, model=state.model) as client:
            await _jobs(client, args, state, view, watcher)
    finally:
        watcher.cancel()
        try:
            await watcher
        except (asyncio.CancelledError, DemoFailed):
            pass


async def _watch_worker(proc: subprocess.Popen, state: DemoState,
                        view: LiveView | PlainView) -> None:
    """Follow the worker's log for its loading stages and start line; DemoFailed when the
    worker exits (it is stopped only after this task)."""
    pos, buf = 0, ""
    while True:
        try:
            with open(state.log_path, errors="replace") as f:
                f.seek(pos)
                chunk = f.read()
                pos = f.tell()
        except OSError:
            chunk = ""
        buf += chunk
        *lines, buf = buf.split("\n")
        for line in lines:
            ev = parse_line(line)
            if ev is None:
                continue
            if ev.kind == "ready":
                state.ready, state.ready_s = ev.text, ev.elapsed_s
            else:
                state.stage, state.stage_at = f"loading {state.model}: {ev.text}", ev.elapsed_s
            view.update()
        if proc.poll() is not None:
            raise DemoFailed(f"the worker exited with code {proc.returncode}; the end of its "
                             f"log ({state.log_path}):\n{_log_tail(state.log_path)}")
        await asyncio.sleep(0.1)


async def _jobs(client: Any, args: argparse.Namespace, state: DemoState,
                view: LiveView | PlainView, watcher: asyncio.Task) -> None:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.jobs)]
    state.jobs = [DemoJob(k + 1, p) for k, p in enumerate(prompts)]
    state.jobs_started_at = time.monotonic()
    for j in state.jobs:
        j.submitted_at = time.monotonic()
    ids = await asyncio.gather(*[
        client.submit(messages=[{"role": "user", "content": j.prompt}],
                      max_tokens=args.max_tokens, temperature=args.temperature)
        for j in state.jobs])
    for j, job_id in zip(state.jobs, ids, strict=True):
        j.job_id = job_id
    view.update()
    followers = asyncio.gather(*[_follow(client, j, view) for j in state.jobs])
    done, _ = await asyncio.wait({followers, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if watcher in done:  # the worker died mid-way
        followers.cancel()
        watcher.result()
    followers.result()
    state.finished_at = time.monotonic()
    view.update()


async def _follow(client: Any, j: DemoJob, view: LiveView | PlainView) -> None:
    from pagedq.wire.schema import FinalEvent

    async for ev in client.stream(j.job_id, timeout=STREAM_TIMEOUT_S):
        now = time.monotonic()
        if isinstance(ev, FinalEvent):
            j.status, j.finish_reason, j.error = ev.status.value, ev.finish_reason, ev.error
            j.text, j.ended_at = ev.text, now
            j.prompt_tokens, j.tokens = ev.usage.prompt_tokens, ev.usage.completion_tokens
        else:
            if j.first_token_at is None:
                j.first_token_at, j.status = now, "streaming"
            j.last_token_at = now
            j.text += ev.delta
            j.tokens += len(ev.token_ids) or 1
        view.update()
