"""`pagedq watch JOB_ID`: one job's text as it is generated, with its status and timings.

On a terminal (and with rich installed: the worker extra brings it) a live panel whose
text grows as tokens arrive, titled with the status, TTFT, tokens/s and elapsed time; its
last frame shows the whole text. With ``--plain``, or when stdout is not a terminal, the
text goes to stdout as it arrives (as `pagedq submit --stream` writes it) and one line of
status and timings to stderr at the end. A job that has already ended is printed the same
way, at once. The exit code tells how the job ended, as for `pagedq result`.

Timings: TTFT is known only when the watch began before the job's first token (from the
job's ``created_at`` to the first token seen here); tokens/s is the decode rate seen here,
or for a job that had ended, its output tokens over its run time (``started_at`` to
``finished_at``). Clocks: the record's times are the worker's, compared with this host's.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import IO, Any

from pagedq.producer.client import Client
from pagedq.wire.schema import TERMINAL, FinalEvent, JobRecord, Status


@dataclass
class Watched:
    job_id: str
    status: str
    created_at: float | None  # wall clock (time.time()) of the record's writer
    started_at: float | None = None
    finished_at: float | None = None
    text: str = ""
    tokens: int = 0
    finish_reason: str = ""
    error: str = ""
    tokens_before: bool = False  # it had produced tokens before the watch began
    first_at: float | None = None  # wall clock of the first token seen here
    last_at: float | None = None

    @classmethod
    def of(cls, rec: JobRecord) -> Watched:
        return cls(rec.id, rec.status.value, rec.created_at, rec.started_at, rec.finished_at,
                   tokens_before=rec.status != Status.queued)

    @property
    def done(self) -> bool:
        return self.status in TERMINAL

    @property
    def ttft(self) -> float | None:
        if self.tokens_before or self.first_at is None or self.created_at is None:
            return None
        return max(0.0, self.first_at - self.created_at)

    @property
    def rate(self) -> float | None:
        if self.tokens_before and self.done and self.started_at and self.finished_at:
            dt = self.finished_at - self.started_at
            return self.tokens / dt if dt > 0 and self.tokens else None
        if self.first_at is None or self.last_at is None or self.tokens < 2:
            return None
        dt = self.last_at - self.first_at
        return (self.tokens - 1) / dt if dt > 0 else None

    def elapsed(self, now: float) -> float | None:
        if self.created_at is None:
            return None
        end = self.finished_at if self.done and self.finished_at else now
        return max(0.0, end - self.created_at)

    def stats(self, now: float) -> str:
        parts = [self.status + (f" ({self.finish_reason})" if self.finish_reason else "")]
        parts.append(f"{self.tokens} tokens")
        parts.append("TTFT " + (f"{self.ttft:.2f} s" if self.ttft is not None else "-"))
        parts.append("-" if self.rate is None else f"{self.rate:.1f} tok/s")
        if (e := self.elapsed(now)) is not None:
            parts.append(f"{e:.1f} s since submit")
        return " · ".join(parts)


def watch(client: Client, job_id: str, out: IO[str], live: bool,
          timeout: float | None = None) -> Watched:
    """Follow the job to its end, showing it; returns what was seen."""
    w = Watched.of(client.status(job_id))  # JobNotFound before anything is shown
    if w.status == Status.running:  # running, but has it streamed a token yet?
        try:
            w.tokens_before = client.redis.xlen(client.keys_of(job_id).out(job_id)) > 0
        except Exception:  # noqa: BLE001 - a user without XLEN: TTFT unknown, no harm
            w.tokens_before = True
    view = _LiveView(w) if live else _PlainView(w, out)
    with view:
        for ev in client.stream(job_id, timeout=timeout):
            now = time.time()
            if isinstance(ev, FinalEvent):
                w.status, w.finish_reason, w.error = ev.status.value, ev.finish_reason, ev.error
                w.tokens = ev.usage.completion_tokens
                view.add(ev.text[len(w.text):])
                w.text = ev.text
                rec = client.status(job_id)
                w.started_at, w.finished_at = rec.started_at, rec.finished_at
                break
            if w.first_at is None:
                w.first_at = now
                if w.status == Status.queued:
                    w.status = Status.running.value
            w.last_at = now
            w.text += ev.delta
            w.tokens += len(ev.token_ids) or 1
            view.add(ev.delta)
    return w


class _PlainView:
    def __init__(self, w: Watched, out: IO[str]) -> None:
        self.w, self.out = w, out

    def __enter__(self) -> _PlainView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.out.write("\n")
        self.out.flush()
        if exc[0] is None:
            print(f"pagedq: job {self.w.job_id} {self.w.stats(time.time())}", file=sys.stderr)

    def add(self, delta: str) -> None:
        self.out.write(delta)
        self.out.flush()


class _LiveView:
    def __init__(self, w: Watched) -> None:
        from rich.console import Console
        from rich.live import Live

        self.w, self.console, self.final = w, Console(), False
        self.live = Live(console=self.console, get_renderable=self.render,
                         refresh_per_second=8, redirect_stderr=False)

    def __enter__(self) -> _LiveView:
        self.live.start(refresh=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.final = True
        self.live.stop()  # the last frame in full

    def add(self, delta: str) -> None:
        pass  # redrawn by rich's refresh thread

    def render(self) -> Any:
        from rich.panel import Panel
        from rich.text import Text

        w = self.w
        body = Text(w.text or ("waiting for the first token..." if not w.done else
                               w.error or "(no text)"), style="" if w.text else "dim")
        if not self.final:  # keep the growing end in view
            lines = body.wrap(self.console, max(20, self.console.width - 4))
            room = max(3, self.console.height - 3)
            if len(lines) > room:
                body = Text("\n").join(lines[-room:])
        style = {"finished": "green", "failed": "red", "cancelled": "red",
                 "expired": "red"}.get(w.status, "yellow")
        return Panel(body, title=f"job {w.job_id}", title_align="left",
                     subtitle=w.stats(time.time()), subtitle_align="left", border_style=style)


def live_possible(plain: bool, out: IO[str]) -> bool:
    if plain or not out.isatty():
        return False
    try:
        import rich  # noqa: F401 - the worker extra installs it; a client-only install may not
    except ImportError:
        return False
    return True


def cmd_watch(args: argparse.Namespace, report: Callable[[str, Status, str, str], int]) -> int:
    with Client(getattr(args, "redis_url", None), prefix=getattr(args, "prefix", None)) as c:
        w = watch(c, args.id, sys.stdout, live_possible(args.plain, sys.stdout), args.timeout)
    return report(args.id, Status(w.status), w.error, w.finish_reason)


def register(subparsers: argparse._SubParsersAction, parents: Iterable[argparse.ArgumentParser],
             run: Callable[[argparse.Namespace], int], epilog: str) -> None:
    """Add `watch`; ``run`` is cmd_watch wrapped by the caller (its exit-code mapping)."""
    help = ("follow a job: its text as it is generated, status, TTFT, tokens/s and elapsed "
            "time (a job that has ended is printed at once); the exit code tells how it ended")
    p = subparsers.add_parser("watch", help=help, description=help, parents=list(parents),
                              epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("id", metavar="ID")
    p.add_argument("--plain", action="store_true",
                   help="the text on stdout as it arrives and a status line on stderr, no live "
                        "view (default: off; on when stdout is not a terminal)")
    p.add_argument("--timeout", type=float, metavar="S",
                   help="most seconds without a new token (default: none, wait forever); "
                        "exit 4 when it runs out")
    p.set_defaults(func=run)
