"""Bulk batches from Python: ``Batches`` (sync) and ``AsyncBatches`` (asyncio).

    from pagedq.batch import Batches
    with Batches("redis://127.0.0.1:6379/0") as b:
        batch = b.create("requests.jsonl", completion_window="24h")
        batch = b.wait(batch.id)
        b.write_results(batch.id, output="out.jsonl", errors="errors.jsonl")

The work happens in rq workers (``pagedq batch worker``) and in the pagedq workers; these
calls create the record and the files, read them, and cancel. The files live in
``batch_dir`` (PAGEDQ_BATCH_DIR), which this process and the rq workers must both see.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

from pagedq.producer.client import Client
from pagedq.wire.errors import InvalidRequest, ResultTimeout
from pagedq.wire.keys import check_name, new_job_id
from pagedq.wire.settings import Settings

from . import files as F
from .ingest import cancel_jobs, load_manifest
from .lines import LANE, VALIDATION_CODES, job_id, read_lines
from .record import Batch, BatchNotFound, BatchStateError
from .record import BatchStatus as S
from .runtime import Runtime, new_token
from .settings import BatchSettings, window_seconds
from .store import BatchStore

MAX_METADATA = 16


class Batches:
    """``Batches(redis_url=None, *, prefix=None, model=None, settings=None,
    batch_settings=None)``; unset arguments come from the PAGEDQ_* environment."""

    def __init__(self, redis_url: str | None = None, *, prefix: str | None = None,
                 model: str | None = None, settings: Settings | None = None,
                 batch_settings: BatchSettings | None = None) -> None:
        self.client = Client(redis_url, prefix=prefix, model=model, settings=settings)
        self.redis_url = redis_url or self.client.settings.redis_url
        self.bs = batch_settings or BatchSettings()
        self.store = BatchStore(self.client.redis, self.client.keys,
                                self.client.settings.partitions)
        self._rt: Runtime | None = None

    @property
    def rt(self) -> Runtime:
        """The control-plane runtime (imports rq: only the calls that enqueue need it)."""
        if self._rt is None:
            self._rt = Runtime.build(self.redis_url, self.client, self.bs)
        return self._rt

    # -- create
    def create(self, input_file: str | Path, *, model: str | None = None,
               completion_window: str | None = None, metadata: dict[str, str] | None = None,
               retry_of: str | None = None) -> Batch:
        """Copy the file into a new batch folder, create the record, queue the ingest.
        InvalidRequest (nothing created) for a bad file, window, model or metadata."""
        window = completion_window or self.bs.batch_completion_window
        try:
            window_s = window_seconds(window)
            model = check_name("model", model or self.client.model)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        meta = _metadata(metadata)
        if LANE not in self.client.settings.lanes:
            raise InvalidRequest(f"this deployment has no {LANE!r} lane (PAGEDQ_LANES="
                                 f"{','.join(self.client.settings.lanes)})")
        queue = self.rt.queue(self.bs.batch_queue)  # (needs rq: fail before making anything)
        batch_id = new_job_id(self.client.settings.partitions, stem="batch_")
        files = F.BatchFiles(self.bs.dir_path() / batch_id)
        try:
            files.folder.mkdir(parents=True)
        except OSError as e:
            raise InvalidRequest(f"cannot make the batch folder (PAGEDQ_BATCH_DIR): {e}") from None
        token, chain = new_token(), new_token()
        try:
            try:
                size, lines, sha = F.copy_input(
                    Path(input_file), files.input, self.bs.batch_max_bytes,
                    self.bs.batch_max_lines, self.bs.batch_max_line_bytes)
            except OSError as e:
                raise InvalidRequest(f"cannot read the input file: {e}") from None
            self.store.create(batch_id, window_s, dict(
                model=model, completion_window=window, window_s=window_s, folder=files.folder,
                input_file=files.input, output_file=files.output, error_file=files.errors,
                lines=lines, input_bytes=size, input_sha256=sha, retry_of=retry_of or "", chain=chain,
                queue=queue.name, metadata=json.dumps(meta) if meta else ""))
        except BaseException:
            F.remove(files.folder)  # nothing was created
            raise
        # the queued ingest owns the lease from now: a tick re-arms it only after it expires
        self.store.lease(batch_id, "ingest_lease", token, self.bs.batch_lease_s)
        self.rt.enqueue_ingest(queue.name, batch_id, token)
        self.rt.enqueue_tick(queue.name, batch_id, chain)
        return self.retrieve(batch_id)

    # -- read
    def retrieve(self, batch_id: str) -> Batch:
        h = self.store.get(batch_id)
        if not h:
            raise BatchNotFound(batch_id)
        return Batch.from_hash(batch_id, h)

    def list(self, limit: int = 20) -> list[Batch]:
        """The newest ``limit`` batches, newest first."""
        r, keys = self.client.redis, self.client.keys
        ids = r.zrevrange(keys.batches, 0, max(0, limit - 1))
        with r.pipeline(transaction=False) as pipe:
            for i in ids:
                pipe.hgetall(self.client.keys_of(i).batch(i))
            hashes = pipe.execute()
        gone = [i for i, h in zip(ids, hashes, strict=True) if not h]
        if gone:  # records past their TTL
            r.zrem(keys.batches, *gone)
        return [Batch.from_hash(i, h) for i, h in zip(ids, hashes, strict=True) if h]

    def results(self, batch_id: str) -> Iterator[dict[str, Any]]:
        """The output lines so far (partial while the batch runs), each request once."""
        return F.unique_rows(F.read_rows(Path(self.retrieve(batch_id).output_file)))

    def errors(self, batch_id: str) -> Iterator[dict[str, Any]]:
        """The error lines so far (invalid lines, failed/expired/cancelled requests)."""
        return F.unique_rows(F.read_all(self._error_sources(self.retrieve(batch_id))))

    def write_results(self, batch_id: str, output: str | Path | None = None,
                      errors: str | Path | None = None,
                      stream: TextIO | None = None) -> tuple[int, int]:
        """Write the output lines to ``output`` (or ``stream``) and the error lines to
        ``errors`` (if given); returns (output lines, error lines)."""
        if output is None and stream is None:
            raise ValueError("write_results needs an output path or a stream")
        b = self.retrieve(batch_id)
        n_out = F.export(Path(b.output_file), Path(output) if output else None, stream)
        n_err = F.export(self._error_sources(b), Path(errors)) if errors else 0
        return n_out, n_err

    @staticmethod
    def _error_sources(b: Batch) -> list[Path]:
        """Once the batch ended, errors.jsonl holds every error line, in input order."""
        return [Path(b.error_file)] if b.done else F.error_sources(Path(b.error_file))

    def wait(self, batch_id: str, timeout: float | None = None, poll_s: float = 0.5,
             on_progress: Callable[[Batch], None] | None = None) -> Batch:
        """Poll until the batch ends (ResultTimeout after ``timeout`` s; it goes on)."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            b = self.retrieve(batch_id)
            if on_progress:
                on_progress(b)
            if b.done:
                return b
            if end is not None and time.monotonic() >= end:
                raise ResultTimeout(f"batch {batch_id} still {b.status.value} after {timeout}s")
            time.sleep(poll_s if end is None else max(0.0, min(poll_s, end - time.monotonic())))

    def rq_workers(self, queue: str | None = None) -> int:
        """How many rq workers are registered on ``queue`` (default: this client's)."""
        from rq import Worker

        return Worker.count(queue=self.rt.queue(queue))

    # -- change
    def cancel(self, batch_id: str) -> Batch:
        """Queued jobs never start, running ones stop; what finished stays in the output.
        BatchStateError if the batch is finalizing or over."""
        ok, st = self.store.transition(batch_id, (S.validating, S.in_progress), S.cancelling)
        if not ok and st == "":
            raise BatchNotFound(batch_id)
        if not ok and st != S.cancelling:
            raise BatchStateError(f"batch {batch_id} is {st}: only a validating or in_progress "
                                  "batch can be cancelled")
        h = self.store.get(batch_id)
        cursor = int(h.get("cursor") or 1)  # the ingest cancels what it submits after this
        cancel_jobs(self.client, [job_id(batch_id, n) for n in range(1, cursor)])
        return Batch.from_hash(batch_id, self.store.get(batch_id) or h)

    def retry(self, batch_id: str, completion_window: str | None = None) -> Batch:
        """A new batch (``retry_of`` = this one) of the lines that were valid but produced
        no output (failed, expired, cancelled). BatchStateError while it runs or if there
        is nothing to retry."""
        old = self.retrieve(batch_id)
        if not old.done:
            raise BatchStateError(f"batch {batch_id} is {old.status.value}: retry it once it "
                                  "has ended")
        redo = {row.get("custom_id") for row in self.errors(batch_id)
                if (row.get("error") or {}).get("code") not in VALIDATION_CODES}
        folder = Path(old.input_file).parent
        wanted = {ln.line for ln in load_manifest(F.BatchFiles(folder)).values()
                  if ln.custom_id in redo} if redo else set()
        if not wanted:
            raise BatchStateError(f"batch {batch_id} has no failed or expired lines to retry")
        tmp = self.bs.dir_path() / f".retry-{batch_id}-{new_token()[:8]}.jsonl"
        try:
            with open(old.input_file, "rb") as fin, open(tmp, "wb") as fout:
                for line, _, raw in read_lines(fin, max_bytes=self.bs.batch_max_line_bytes):
                    if line in wanted and raw is not None:  # (a valid line is in the cap)
                        fout.write(raw if raw.endswith(b"\n") else raw + b"\n")
            return self.create(tmp, model=old.model,
                               completion_window=completion_window or old.completion_window,
                               metadata=old.metadata, retry_of=batch_id)
        finally:
            tmp.unlink(missing_ok=True)

    # -- lifecycle
    def close(self) -> None:
        if self._rt is not None:
            self._rt.close()
        else:
            self.client.close()

    def __enter__(self) -> Batches:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _metadata(meta: dict[str, str] | None) -> dict[str, str]:
    meta = dict(meta or {})
    if len(meta) > MAX_METADATA or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
            for k, v in meta.items()):
        raise InvalidRequest(f"metadata: at most {MAX_METADATA} string pairs, keys <= 64 and "
                             "values <= 512 characters")
    return meta


class AsyncBatches:
    """The same operations as coroutines. Each runs the sync call in a worker thread
    (file I/O and rq are blocking); ``wait`` polls with ``asyncio.sleep``."""

    def __init__(self, redis_url: str | None = None, **kwargs: Any) -> None:
        self.sync = Batches(redis_url, **kwargs)

    async def create(self, input_file: str | Path, **kwargs: Any) -> Batch:
        return await asyncio.to_thread(self.sync.create, input_file, **kwargs)

    async def retrieve(self, batch_id: str) -> Batch:
        return await asyncio.to_thread(self.sync.retrieve, batch_id)

    async def list(self, limit: int = 20) -> list[Batch]:
        return await asyncio.to_thread(self.sync.list, limit)

    async def results(self, batch_id: str) -> list[dict[str, Any]]:
        return await asyncio.to_thread(lambda: list(self.sync.results(batch_id)))

    async def errors(self, batch_id: str) -> list[dict[str, Any]]:
        return await asyncio.to_thread(lambda: list(self.sync.errors(batch_id)))

    async def write_results(self, batch_id: str, output: str | Path | None = None,
                            errors: str | Path | None = None) -> tuple[int, int]:
        return await asyncio.to_thread(self.sync.write_results, batch_id, output, errors)

    async def cancel(self, batch_id: str) -> Batch:
        return await asyncio.to_thread(self.sync.cancel, batch_id)

    async def retry(self, batch_id: str, completion_window: str | None = None) -> Batch:
        return await asyncio.to_thread(self.sync.retry, batch_id, completion_window)

    async def wait(self, batch_id: str, timeout: float | None = None,
                   poll_s: float = 0.5) -> Batch:
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            b = await self.retrieve(batch_id)
            if b.done:
                return b
            if end is not None and time.monotonic() >= end:
                raise ResultTimeout(f"batch {batch_id} still {b.status.value} after {timeout}s")
            await asyncio.sleep(poll_s)

    async def close(self) -> None:
        await asyncio.to_thread(self.sync.close)

    async def __aenter__(self) -> AsyncBatches:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
