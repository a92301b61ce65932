"""What `pagedq demo` shows: the worker loading, then one line per job whose answer grows
as its tokens arrive (status, TTFT, tokens/s), then one summary table.

Two views of one state (``DemoState``): ``LiveView`` redraws it in place on a terminal
(rich), ``PlainView`` prints plain lines fit for a log or CI: a job's answer once, when
the job ends. The live view keeps each job to the last lines of its answer while jobs run,
so the whole view fits the terminal; its last frame (drawn when it stops) shows every
answer in full, and the summary table follows it once.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import IO, Any

TERMINAL = ("finished", "failed", "cancelled", "expired")


@dataclass
class DemoJob:
    index: int
    prompt: str
    job_id: str = ""
    status: str = "queued"  # queued, streaming, then the job's terminal status
    text: str = ""
    tokens: int = 0
    submitted_at: float = 0.0  # time.monotonic() of each
    first_token_at: float | None = None
    last_token_at: float | None = None
    ended_at: float | None = None
    finish_reason: str = ""
    prompt_tokens: int = 0
    error: str = ""

    @property
    def done(self) -> bool:
        return self.status in TERMINAL

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.submitted_at

    @property
    def rate(self) -> float | None:
        """Decode tokens/s: the tokens after the first over the time since the first."""
        if self.first_token_at is None or self.last_token_at is None or self.tokens < 2:
            return None
        dt = self.last_token_at - self.first_token_at
        return (self.tokens - 1) / dt if dt > 0 else None

    @property
    def total_s(self) -> float | None:
        return None if self.ended_at is None else self.ended_at - self.submitted_at


@dataclass
class DemoState:
    redis: str = ""
    prefix: str = ""
    log_path: str = ""
    model: str = ""
    started_at: float = field(default_factory=time.monotonic)
    stage: str = "starting the worker process"
    stage_at: float = 0.0  # seconds into the worker's start when the stage began
    ready: str = ""  # the worker's start line (after "ready in T s: ")
    ready_s: float | None = None
    jobs: list[DemoJob] = field(default_factory=list)
    jobs_started_at: float | None = None
    finished_at: float | None = None


def fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} s"


def fmt_rate(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def summary_rows(state: DemoState) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the summary table, the last row the totals."""
    head = ["job", "status", "finish", "prompt tok", "output tok", "TTFT", "tok/s", "total"]
    rows = [[str(j.index), j.status, j.finish_reason or "-", str(j.prompt_tokens),
             str(j.tokens), fmt_s(j.ttft), fmt_rate(j.rate), fmt_s(j.total_s)]
            for j in state.jobs]
    wall = None
    if state.jobs_started_at is not None and state.finished_at is not None:
        wall = state.finished_at - state.jobs_started_at
    out = sum(j.tokens for j in state.jobs)
    ttfts = [j.ttft for j in state.jobs if j.ttft is not None]
    rows.append(["all", f"{sum(j.status == 'finished' for j in state.jobs)}/{len(state.jobs)} "
                        "finished", "", str(sum(j.prompt_tokens for j in state.jobs)), str(out),
                 fmt_s(sum(ttfts) / len(ttfts)) if ttfts else "-",
                 fmt_rate(out / wall) if wall else "-", fmt_s(wall)])
    return head, rows


SUMMARY_TITLE = "pagedq demo: summary"
SUMMARY_NOTE = ("TTFT: submit to first token; tok/s: per job, its decode rate; in the "
                "last row, all output tokens over the wall time (mean TTFT)")


# ---- plain lines --------------------------------------------------------------------------

class PlainView:
    """Plain lines: the worker's stages, each job's answer when it ends, the summary."""

    def __init__(self, state: DemoState, out: IO[str]) -> None:
        self.s, self.out = state, out
        self._printed: set[int] = set()
        self._stages: set[str] = set()

    def __enter__(self) -> PlainView:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def say(self, line: str) -> None:
        self.out.write(line + "\n")
        self.out.flush()

    def update(self) -> None:
        s = self.s
        if s.ready and "ready" not in self._stages:
            self._stages.add("ready")
            self.say(f"worker: ready in {s.ready_s:.1f} s: {s.ready}")
        elif not s.ready and s.stage not in self._stages:
            self._stages.add(s.stage)
            self.say(f"worker: {s.stage} ({s.stage_at:.1f} s)")
        for j in s.jobs:
            if j.done and j.index not in self._printed:
                self._printed.add(j.index)
                self.say(f"[job {j.index}] {j.prompt}")
                for line in (j.text.strip() or "(no text)").splitlines():
                    self.say(f"    {line}")
                why = f" ({j.finish_reason})" if j.finish_reason else ""
                err = f": {j.error}" if j.error else ""
                self.say(f"    -- {j.status}{why}{err}, {j.tokens} tokens, TTFT {fmt_s(j.ttft)}, "
                         f"{fmt_rate(j.rate)} tok/s")

    def summary(self) -> None:
        head, rows = summary_rows(self.s)
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        self.say(f"\n{SUMMARY_TITLE}")
        for r in [head, *rows]:
            self.say("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
        self.say(SUMMARY_NOTE)


# ---- the live view (rich) ---------------------------------------------------------------

_MARK = {"queued": ("·", "dim"), "streaming": ("●", "yellow"), "finished": ("✓", "green"),
         "failed": ("✗", "red"), "cancelled": ("✗", "red"), "expired": ("✗", "red")}


class LiveView:
    """A rich Live view, redrawn 8 times a second and on every update."""

    def __init__(self, state: DemoState, console: Any = None) -> None:
        from rich.console import Console
        from rich.live import Live

        self.s = state
        self.console = console or Console()
        self.final = False  # the last frame shows whole answers
        self.live = Live(console=self.console, get_renderable=self.render,
                         refresh_per_second=8, transient=False, redirect_stderr=False)

    def __enter__(self) -> LiveView:
        self.live.start(refresh=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.final = True
        self.live.stop()  # draws the last frame in full

    def say(self, line: str) -> None:
        self.live.console.print(line, markup=False, highlight=False)

    def update(self) -> None:
        pass  # redrawn by rich's refresh thread, 8 times a second

    def render(self) -> Any:
        from rich.console import Group
        from rich.spinner import Spinner
        from rich.table import Table
        from rich.text import Text

        s, now = self.s, time.monotonic()
        width = max(40, self.console.width)
        parts: list[Any] = [Text.assemble(("pagedq demo", "bold"), f"  redis {s.redis}",
                                          f"  prefix {s.prefix}", style="dim")]
        if s.ready:  # model, KV cache, batch size (the rest of the start line: the log)
            brief = " · ".join(s.ready.split(" | ")[1:4]) or s.ready
            parts.append(Text.assemble(("✓ ", "green"), (f"worker ready in {s.ready_s:.1f} s: ",
                                                         "bold"), brief))
        else:
            waited = now - s.started_at
            row = Table.grid(padding=(0, 1))
            row.add_row(Spinner("dots", style="cyan"),
                        Text.assemble(("worker: ", "bold"), s.stage, (f"  {waited:.1f} s", "dim")))
            parts.append(row)
        parts.append(Text(""))
        if s.jobs:
            budget = self._answer_lines(len(s.jobs))
            for j in s.jobs:
                parts.extend(self._job(j, width, budget, now))
        elif s.ready:
            parts.append(Text("submitting jobs...", style="dim"))
        return Group(*parts)

    def _answer_lines(self, n: int) -> int | None:
        """Lines of answer each job may show while the view is live (None: all)."""
        if self.final:
            return None
        free = self.console.height - 4 - 2 * n  # header, worker, gap; a job's title + gap
        return max(1, free // max(1, n))

    def _job(self, j: DemoJob, width: int, budget: int | None, now: float) -> list[Any]:
        from rich.text import Text

        mark, style = _MARK.get(j.status, ("?", ""))
        stats = [j.status + (f" ({j.finish_reason})" if j.finish_reason else "")]
        if j.ttft is not None:
            stats.append(f"TTFT {j.ttft:.2f} s")
        if j.rate is not None:
            stats.append(f"{j.rate:.1f} tok/s")
        stats.append(f"{j.tokens} tok")
        title = Text.assemble((f"{mark} job {j.index} ", style), (j.prompt, "bold"),
                              ("  " + " · ".join(stats), "dim"))
        title.truncate(width, overflow="ellipsis")
        body = Text(j.text.strip() or ("waiting for the first token..." if not j.done else
                                       j.error or "(no text)"),
                    style="" if j.text.strip() else "dim")
        lines = body.wrap(self.console, width - 4)
        if budget is not None and len(lines) > budget:
            lines = lines[-budget:]  # the growing end of the answer
        out: list[Any] = [title]
        out.extend(Text("    ") + line for line in lines)
        return out

    def summary(self) -> None:
        from rich.table import Table

        head, rows = summary_rows(self.s)
        t = Table(title=SUMMARY_TITLE, title_justify="left", caption=SUMMARY_NOTE,
                  caption_justify="left")
        for h in head:
            t.add_column(h, justify="left" if h in ("job", "status", "finish") else "right")
        for r in rows[:-1]:
            t.add_row(*r)
        t.add_section()
        t.add_row(*rows[-1], style="bold")
        self.console.print(t)
