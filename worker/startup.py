"""What `pagedq worker` tells a person while it starts, on stderr, before its JSON logs:

    pagedq: loading smollm2: importing torch (0.0 s)
    pagedq: loading smollm2: reading the model's config and tokenizer (1.6 s)
    pagedq: loading smollm2: loading weights to cpu float32 (2.9 s)
    pagedq: loading smollm2: allocating the KV cache (1456 blocks) (7.7 s)
    pagedq: ready in 7.9 s: worker w1 | model smollm2 on cpu, float32 | KV cache 1,456 blocks
            x 16 = 23,296 tokens (1.00 GiB) | max 64 seqs, 2,048 tokens/step, context 8,192 |
            metrics off | redis://127.0.0.1:6379/0 prefix pagedq

(the ready line is one line). On a terminal the loading line is rewritten in place, so a
person sees one line that moves, then the start line; elsewhere (a log file, a pipe) each
stage is its own line. `pagedq demo` reads these lines from its worker's log
(``parse_line``), so their shape is defined here, once.
"""
from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass
from typing import IO, Any

LOADING = "pagedq: loading "
READY = "pagedq: ready in "
_LOADING_RE = re.compile(r"^pagedq: loading (?P<model>.+?): (?P<stage>.+) \((?P<t>[\d.]+) s\)$")
_READY_RE = re.compile(r"^pagedq: ready in (?P<t>[\d.]+) s: (?P<rest>.+)$")


@dataclass(frozen=True, slots=True)
class StartEvent:
    kind: str  # "loading" or "ready"
    text: str  # the stage, or the ready line after "ready in T s: "
    elapsed_s: float  # seconds since the worker process began loading


def parse_line(line: str) -> StartEvent | None:
    """A loading or ready line of a worker's stderr, else None (a JSON log line, ...)."""
    line = line.rstrip("\n").rpartition("\r")[2].removeprefix("\033[K")
    if m := _LOADING_RE.match(line):
        return StartEvent("loading", m["stage"], float(m["t"]))
    if m := _READY_RE.match(line):
        return StartEvent("ready", m["rest"], float(m["t"]))
    return None


class StartReporter:
    """Prints the loading stages and then the start line (see the module docstring).
    Use as a context manager around the model load: an error leaves no half line behind,
    so the one-line configuration error that follows starts on a line of its own."""

    def __init__(self, model: str, stream: IO[str] | None = None) -> None:
        self.model = model
        self.out = stream or sys.stderr
        self.tty = self.out.isatty()
        self.t0 = time.monotonic()
        self._partial = False  # a loading line without its newline is on the terminal

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def stage(self, text: str) -> None:
        line = f"{LOADING}{self.model}: {text} ({self.elapsed():.1f} s)"
        if self.tty:
            self.out.write("\r\033[K" + line)
            self._partial = True
        else:
            self.out.write(line + "\n")
        self.out.flush()

    def end_line(self) -> None:
        if self._partial:
            self.out.write("\r\033[K")
            self.out.flush()
            self._partial = False

    def ready(self, engine: Any, cfg: Any, worker_id: str) -> str:
        """Print the start line and return it."""
        self.end_line()
        line = f"{READY}{self.elapsed():.1f} s: {describe(engine, cfg, worker_id)}"
        self.out.write(line + "\n")
        self.out.flush()
        return line

    def __enter__(self) -> StartReporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.end_line()


def describe(engine: Any, cfg: Any, worker_id: str) -> str:
    """The start line after "ready in T s: " (engine: an LLMEngine; cfg: worker/config.py's
    Resolved)."""
    from pagedq.wire.redis_errors import redact_url

    r, c, s = engine.runner, engine.config, cfg.service
    dtype = str(r.dtype).removeprefix("torch.")
    kv_dtype = r.kv_label
    blocks = r.num_kv_blocks
    gib = r.kv_cache_bytes / 2**30
    kv = f"KV cache {blocks:,} blocks x {c.block_size} = {blocks * c.block_size:,} tokens " \
         f"({gib:.2f} GiB{'' if kv_dtype == dtype else ', ' + kv_dtype})" \
        + (f", CUDA graphs {r.graph_bytes / 2**30:.2f} GiB" if r.graph_bytes else "")
    metrics = f"metrics http://{_host(s.metrics_host)}:{s.metrics_port}/metrics" \
        if s.metrics_port else "metrics off"
    prefixes = ",".join(s.served_prefixes)
    return " | ".join([
        f"worker {worker_id}",
        f"model {s.model} on {r.device}, {dtype}"
        + (f", {r.quant_summary}" if r.quant_summary else ""),
        kv,
        f"max {c.max_num_seqs} seqs, {c.max_num_batched_tokens:,} tokens/step, "
        f"context {engine.max_model_len:,}"
        + (f", arrivals wait <= {c.prefill_wait_steps} steps" if c.prefill_wait_steps else ""),
        metrics,
        f"{redact_url(s.redis_url)}{' (cluster)' if s.redis_cluster else ''} prefix "
        f"{prefixes}{f' x {s.partitions} partitions' if s.partitions > 1 else ''}, "
        f"lanes {','.join(s.lanes)}",
    ])


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
