"""Bulk generation: OpenAI Batch JSONL files fanned out through rq (docs/batches.md).

rq runs the control plane (ingest, progress, finalize: batch/jobs.py); the jobs
themselves ride the "batch" lane of the pagedq service. Importing this package does not
import rq (only the calls that enqueue, and the batch worker, do).
"""
from .api import AsyncBatches, Batches
from .record import Batch, BatchNotFound, BatchStateError, BatchStatus, RequestCounts
from .settings import BatchSettings

__all__ = ["AsyncBatches", "Batch", "BatchNotFound", "BatchSettings", "BatchStateError",
           "BatchStatus", "Batches", "RequestCounts"]
