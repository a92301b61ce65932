"""Settings of bulk batches, beside wire/settings.py's: each field is overridable by the
environment variable PAGEDQ_<NAME> (e.g. PAGEDQ_BATCH_DIR) or by the matching CLI flag."""
from __future__ import annotations

import os
import re
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from .lines import MAX_LINE_BYTES

_WINDOW_RE = re.compile(r"^([1-9][0-9]{0,6})([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_WINDOW_S = 7 * 86400  # a job's timeout_s is at most 7 days (wire/schema.py)


def default_batch_dir() -> str:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local",
                                                            "share")
    return os.path.join(base, "pagedq", "batches")


class BatchSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PAGEDQ_", extra="ignore")

    # where each batch gets its folder: input copy, manifest, output and error JSONL. The
    # submitter and the rq workers must see the same folder (one machine, or a shared mount).
    batch_dir: str = Field(default_factory=default_batch_dir)
    # limits of one input file (OpenAI's: 50,000 requests, 200 MB = 200,000,000 bytes), and
    # of one line, in bytes without its newline (the gateway's request body limit: a line
    # is read with this cap, never held whole past it)
    batch_max_lines: int = Field(50_000, ge=1)
    batch_max_bytes: int = Field(200_000_000, ge=1)
    batch_max_line_bytes: int = Field(MAX_LINE_BYTES, ge=1024)
    batch_completion_window: str = "24h"
    # the rq queue of the control plane (ingest and tick jobs)
    batch_queue: str = "pagedq-batch"
    # the Redis of the rq queues (default: the jobs' PAGEDQ_REDIS_URL). rq cannot use a
    # Redis Cluster: with PAGEDQ_REDIS_CLUSTER set, give a plain Redis here (same
    # credentials and TLS settings)
    batch_rq_url: str | None = None
    # seconds between two ticks (collect progress, finalize) of a batch
    batch_poll_s: float = Field(1.0, gt=0)
    # an ingest or tick that has not shown life for this long is presumed dead and re-armed
    batch_lease_s: float = Field(30.0, gt=0)
    # batches share a lane: each keeps at most this many jobs queued or running (its
    # window); the ingest pauses when it is full and a tick resumes it, so a small batch
    # submitted after a large one is not queued behind all of the large one's lines
    batch_window_jobs: int = Field(2000, ge=1)
    # SUBMITs sent in one pipeline by the ingest
    batch_chunk_lines: int = Field(500, ge=1)
    # one ingest rq job runs at most this long, then hands over to a continuation job queued
    # behind the jobs waiting meanwhile (ticks of this and other batches get their turn)
    batch_ingest_slice_s: float = Field(10.0, gt=0)
    # after expires_at + this, jobs the service has not ended yet are cancelled (reported
    # batch_expired), so the batch ends even when workers are busy or gone
    batch_expiry_grace_s: float = Field(10.0, ge=0)
    # a job's out stream is deleted once its line is in the output or error file, and its
    # record kept this long after (not the service's PAGEDQ_RESULT_TTL_S)
    batch_collected_ttl_s: int = Field(300, ge=1)
    # a terminal batch's record is kept this long (its files stay until you delete them)
    batch_record_ttl_s: int = Field(30 * 86400, ge=60)
    # the batch worker's /metrics (batch/metrics.py; needs prometheus-client, in the worker
    # and gateway extras): 0 = off; the host: loopback unless you open it
    batch_metrics_port: int = Field(0, ge=0, le=65535)
    batch_metrics_host: str = "127.0.0.1"

    def rq_url(self, redis_url: str, cluster: bool) -> str:
        """The rq queues' Redis URL (``batch_rq_url``, else ``redis_url``); ValueError when
        that would be a Redis Cluster."""
        if self.batch_rq_url:
            return self.batch_rq_url
        if cluster:
            raise ValueError("PAGEDQ_REDIS_CLUSTER is set: rq cannot use a Redis Cluster; set "
                             "PAGEDQ_BATCH_RQ_URL to a plain Redis for the batch queues")
        return redis_url

    def dir_path(self) -> Path:
        return Path(self.batch_dir).expanduser().resolve()


def window_seconds(window: str) -> int:
    """``"24h"`` -> 86400. Accepts N followed by s, m, h or d, up to 7 days."""
    m = _WINDOW_RE.match(window or "")
    if not m:
        raise ValueError(f"invalid completion_window {window!r}: use a number and s, m, h or d "
                         "(e.g. 24h)")
    seconds = int(m[1]) * _UNIT_S[m[2]]
    if seconds > MAX_WINDOW_S:
        raise ValueError(f"completion_window {window!r} is longer than 7 days")
    return seconds
