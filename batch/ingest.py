"""The ingest rq job: validate the input once, then fan its valid lines out as jobs.

Invariants (what makes it safe to kill at any point and run again):
* one ingest at a time holds the batch's ``ingest_lease``; every write to the record is
  fenced by it, and it is refreshed before every SUBMIT pipeline;
* validation writes manifest.jsonl and invalid.jsonl (whole files, renamed into place)
  before ``validated=1``; a re-run writes the same files again (and touches nothing the
  collector writes);
* a line's job id is ``<batch id>.<line>`` and its body is the same on every run except
  ``timeout_s`` (the seconds left in the window): SUBMIT answers 'exists' for a job already
  made with the same body and 'conflict' for one made by an earlier run with another
  timeout_s; both mean the job exists (no one else makes ids from this batch's uuid);
* ``cursor``: every valid line below it has a job and ``submitted`` counts them. Jobs exist
  only below the cursor or in the one chunk after it (a run that died mid-chunk); a run
  that stops for good (cancel, window over) counts those too (``extra``) before it sets
  ``ingested=1``; after that nothing is submitted any more;
* a process asked to stop (``runtime.stopping``: the batch worker's SIGTERM) hands the rest
  over to a continuation job at once, even in the middle of a chunk held back by
  backpressure: the continuation starts at the cursor, as a re-run after a crash does.
"""
from __future__ import annotations

import json
import time
from collections.abc import Iterator
from itertools import islice
from pathlib import Path

from pagedq.producer.client import Client
from pagedq.wire import script, scripts
from pagedq.wire.errors import JobConflict, Overloaded

from . import lines as L
from .files import BatchFiles, read_rows, write_rows
from .record import BatchStatus as S
from .runtime import Runtime, stopping
from .shape import invalid_line

LEASE = "ingest_lease"
MAX_ERRORS_SHOWN = 100  # a failed batch's "errors" lists at most this many lines
HAND_OVER = "this process is stopping"  # FanOut.submit's: the chunk is not all in


def run_ingest(rt: Runtime, batch_id: str, token: str) -> str:
    store, lease_s = rt.store, rt.bs.batch_lease_s
    if store.lease(batch_id, LEASE, token, lease_s) != 1:
        return "another ingest holds the lease (or the batch is gone)"
    h = store.get(batch_id)
    if h.get("ingested") == "1" or h.get("status") not in (S.validating, S.in_progress,
                                                             S.cancelling):
        store.release(batch_id, LEASE, token)
        return "nothing to ingest"
    files = BatchFiles(Path(h["folder"]))
    if h.get("validated") != "1":
        if not validate(rt, batch_id, h, files, token):
            return "validation ended the ingest"
        h = store.get(batch_id)
    return FanOut(rt, batch_id, h, files, token).run()


def validate(rt: Runtime, batch_id: str, h: dict[str, str], files: BatchFiles,
             token: str) -> bool:
    """Validate every line; False when there is nothing to fan out."""
    store, lease_s = rt.store, rt.bs.batch_lease_s
    check = L.Validator(batch_id, h["model"])
    valid: list[L.Line] = []
    invalid: list[L.LineError] = []
    n = 0
    try:
        with open(files.input, "rb") as f:
            for line, _, raw in L.read_lines(f, max_bytes=rt.bs.batch_max_line_bytes):
                n += 1
                res = check.check(raw, line, rt.bs.batch_max_line_bytes)
                (invalid if isinstance(res, L.LineError) else valid).append(res)
                if n % 1000 == 0 and store.lease(batch_id, LEASE, token, lease_s,
                                                 checked=n) != 1:
                    return False
    except OSError as e:
        store.transition(batch_id, (S.validating, S.cancelling), S.failed,
                         rt.bs.batch_record_ttl_s, ingested=1, errors=json.dumps(errors_object(
                             [{"code": "input_unreadable", "message": str(e)}])))
        return False
    write_rows(files.manifest, (ln.row() for ln in valid))
    write_rows(files.invalid, (invalid_line(e, batch_id) for e in invalid))
    files.output.touch()  # (never truncates: the collector may be appending already)
    files.errors.touch()
    fields = dict(validated=1, lines=n, checked=n, total=len(valid), invalid=len(invalid), cursor=1,
                  cursor_off=0, submitted=0)
    if not valid:
        fields["ingested"] = 1
    if store.lease(batch_id, LEASE, token, lease_s, **fields) != 1:
        return False
    if not valid:  # no job will ever append: the error file is the invalid lines
        write_rows(files.errors, (invalid_line(e, batch_id) for e in invalid))
        store.transition(batch_id, (S.validating,), S.failed, rt.bs.batch_record_ttl_s,
                         final_completed=0, final_failed=n, errors=json.dumps(errors_object(
                             [{"code": e.code, "message": e.message, "line": e.line}
                              for e in invalid])))
        return False  # (if it was cancelled meanwhile, the tick ends it as cancelled)
    store.transition(batch_id, (S.validating,), S.in_progress)
    return True


def errors_object(data: list[dict]) -> dict:
    """A failed batch's ``errors``, OpenAI's shape: the first MAX_ERRORS_SHOWN problems."""
    return {"object": "list", "data": [{"param": None, "line": None, **d}
                                       for d in data[:MAX_ERRORS_SHOWN]]}


_manifests: dict[tuple[str, int, int], dict[int, L.Line]] = {}


def load_manifest(files: BatchFiles) -> dict[int, L.Line]:
    """line -> Line of the valid lines (cached per file version: ticks read it often)."""
    st = files.manifest.stat()
    key = (str(files.manifest), st.st_mtime_ns, st.st_size)
    if key not in _manifests:
        if len(_manifests) > 16:
            _manifests.clear()
        _manifests[key] = {ln.line: ln for ln in map(L.Line.from_row,
                                                     read_rows(files.manifest))}
    return _manifests[key]


class FanOut:
    """Submits the valid lines from the cursor on, a pipeline of SUBMITs per chunk."""

    def __init__(self, rt: Runtime, batch_id: str, h: dict[str, str], files: BatchFiles,
                 token: str) -> None:
        self.rt, self.batch_id, self.files, self.token = rt, batch_id, files, token
        self.model, self.expires_at, self.queue = h["model"], float(h["expires_at"]), h["queue"]
        self.cursor, self.offset = int(h["cursor"]), int(h["cursor_off"])
        self.submitted = int(h["submitted"])
        self.manifest = load_manifest(files)
        self.slice_end = time.monotonic() + rt.bs.batch_ingest_slice_s

    def run(self) -> str:
        with open(self.files.input, "rb") as f:
            f.seek(self.offset)
            todo = ((line, off, raw) for line, off, raw in L.read_lines(
                f, self.cursor, self.rt.bs.batch_max_line_bytes) if line in self.manifest)
            while True:
                room = self.room()
                if room <= 0:  # (a batch cancelled meanwhile stops rather than waits)
                    if self.status() not in (S.validating, S.in_progress):
                        return self.stop("cancelled")
                    return self.pause()
                chunk = list(islice(todo, min(self.rt.bs.batch_chunk_lines, room)))
                if not chunk:
                    return self.stop("all lines submitted")
                stopped = self.submit(chunk)
                if stopped == HAND_OVER:
                    return self.hand_over()
                if stopped:
                    return self.stop(stopped, chunk)
                last_line, last_off, _ = chunk[-1]
                if not self.fenced(cursor=last_line + 1, cursor_off=last_off,
                                   submitted=self.submitted + len(chunk)):
                    return "lease lost"
                self.cursor, self.offset = last_line + 1, last_off
                self.submitted += len(chunk)
                if self.status() == S.cancelling:  # stop the jobs of this chunk at once
                    self.cancel_jobs(line for line, _, _ in chunk)
                if time.monotonic() > self.slice_end or stopping.is_set():
                    return self.hand_over()

    def hand_over(self) -> str:
        """End this rq job and queue a continuation from the cursor (same lease token)."""
        if not self.fenced():
            return "lease lost"
        self.rt.enqueue_ingest(self.queue, self.batch_id, self.token)
        return "slice over: a continuation is queued"

    def submit(self, chunk: list[tuple[int, int, bytes]]) -> str | None:
        """SUBMIT the chunk's lines until all are in; a line refused as Overloaded is sent
        again after a backoff. Returns why it stopped early (cancel, window over, HAND_OVER),
        or None."""
        pending = {line: raw for line, _, raw in chunk}
        delay = 0.05
        while pending:
            if not self.fenced():
                return "lease lost"
            if self.status() not in (S.validating, S.in_progress):
                return "cancelled"
            now, _ = self.rt.store.clock(self.batch_id)
            left = self.expires_at - now
            if left <= 0:
                return "window over"
            reqs = []
            for line, raw in pending.items():
                req = L.request(L.parse(raw, line, self.model), self.batch_id, self.model, left)
                if isinstance(req, L.LineError):  # validated before: cannot happen
                    raise RuntimeError(f"line {line} no longer validates: {req.message}")
                reqs.append((line, req))
            for (line, _req), result in zip(reqs, self._send(reqs), strict=True):
                try:
                    if isinstance(result, Exception):  # the job id otherwise
                        raise result
                except Overloaded:
                    continue
                except JobConflict:
                    pass  # made by an earlier run of this ingest with another timeout_s
                del pending[line]
            if pending:
                if stopping.wait(delay):  # the backoff, cut short by a stop request
                    return HAND_OVER
                delay = min(2.0, self.rt.bs.batch_lease_s / 3, delay * 2)  # lease stays alive
        return None

    def room(self) -> int:
        """How many more jobs this batch may have queued or running (its window on the lane:
        batches share a lane by each keeping at most ``batch_window_jobs`` jobs in it)."""
        done = self.rt.r.hmget(self.rt.bkeys(self.batch_id).batch(self.batch_id),
                               "completed", "failed")
        ended = sum(int(x or 0) for x in done)
        return self.rt.bs.batch_window_jobs - (self.submitted - ended)

    def pause(self) -> str:
        """The window is full: give the lease up; a tick resumes the ingest (``paused``)."""
        if not self.fenced(paused=1):
            return "lease lost"
        self.rt.store.release(self.batch_id, LEASE, self.token)
        return "window full: a tick resumes the ingest"

    def _send(self, reqs: list) -> list:
        c = self.rt.client
        calls = [scripts.Submit(c.keys, req, c.settings, batch=(self.batch_id, str(line)))
                 for line, req in reqs]
        return c._retry(script.pipelined, c.redis, calls)

    def stop(self, why: str, chunk: list[tuple[int, int, bytes]] | None = None) -> str:
        """Stop for good: count the jobs an interrupted chunk made beyond the cursor."""
        extra = self.existing(line for line, _, _ in chunk) if chunk else []
        if why == "lease lost" or not self.fenced(
                ingested=1, extra=",".join(map(str, extra)),
                submitted=self.submitted + len(extra)):
            return "lease lost"
        if why == "cancelled":
            self.cancel_jobs(extra)
        self.rt.store.release(self.batch_id, LEASE, self.token)
        return why

    def existing(self, lines: Iterator[int]) -> list[int]:
        lines = list(lines)
        r = self.rt.r
        with r.pipeline(transaction=False) as pipe:
            for line in lines:
                pipe.exists(self.rt.bkeys(self.batch_id).job(L.job_id(self.batch_id, line)))
            found = pipe.execute()
        return [line for line, n in zip(lines, found, strict=True) if n]

    def cancel_jobs(self, lines: Iterator[int] | list[int]) -> None:
        cancel_jobs(self.rt.client, [L.job_id(self.batch_id, line) for line in lines])

    def fenced(self, **fields: object) -> bool:
        """Refresh the lease (and set ``fields``) while it is ours."""
        return self.rt.store.lease(self.batch_id, LEASE, self.token, self.rt.bs.batch_lease_s,
                                   **fields) == 1

    def status(self) -> str | None:
        return self.rt.r.hget(self.rt.bkeys(self.batch_id).batch(self.batch_id), "status")


def cancel_jobs(c: Client, job_ids: list[str]) -> None:
    """CANCEL each job, pipelined (queued ones end at once, running ones are asked to stop;
    ended or missing ones are left alone)."""
    for i in range(0, len(job_ids), 1000):
        calls = [scripts.Cancel(c.keys, jid, c.settings) for jid in job_ids[i:i + 1000]]
        c._retry(script.pipelined, c.redis, calls)
