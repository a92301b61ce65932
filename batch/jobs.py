"""The rq job functions of the control plane (stable dotted names: rq stores them in each
job, serialized as JSON with the arguments, which are plain strings)."""
from __future__ import annotations

from .collect import run_tick
from .ingest import run_ingest
from .runtime import runtime


def ingest(prefix: str, batch_id: str, token: str) -> str:
    """Validate and fan out a batch (or continue doing so); safe to run again."""
    return run_ingest(runtime(prefix), batch_id, token)


def tick(prefix: str, batch_id: str, chain: str) -> str:
    """Collect progress and finalize; schedules the next tick while the batch runs."""
    return run_tick(runtime(prefix), batch_id, chain)
