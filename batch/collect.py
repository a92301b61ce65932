"""The tick rq job of a batch: keep the ingest alive, collect ended jobs into the files,
cancel what must stop, finalize. Runs every ``batch_poll_s`` until the batch ends.

Invariants:
* one chain of ticks per batch: a tick carries the chain token, and one whose token is
  not the record's ``chain`` does nothing (the watchdog starts a new chain when ``beat``
  goes stale, e.g. after the rq scheduler died with its worker);
* a tick schedules its successor before it works, so a tick killed midway does not end
  the chain; one collector at a time holds ``tick_lease``;
* the service pushes ``<line>`` on ``keys.batch_done`` as each job ends (atomically with
  the ``completed``/``failed`` counters). The collector reads the head of that list, appends
  the results to the files, then trims exactly what it wrote (fenced by its lease): a
  crash re-delivers, never loses (duplicates are dropped by ``files.unique_rows``);
* finalize only when the ingest is over (``ingested``), every job it made has ended
  (``completed + failed == submitted``) and the list is drained.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from . import lines as L
from .files import BatchFiles, append_rows, key_of, read_all, read_rows, unique_rows, write_rows
from .ingest import cancel_jobs, errors_object, load_manifest, run_ingest
from .record import BATCH_TERMINAL
from .record import BatchStatus as S
from .runtime import Runtime, new_token
from .shape import CANCELLED, EXPIRED, error_line, outcome, usage_of

LEASE = "tick_lease"
COLLECT_CHUNK = 1000


def run_tick(rt: Runtime, batch_id: str, chain: str) -> str:
    store, bs = rt.store, rt.bs
    h = store.get(batch_id)
    if not h:
        return "gone"
    if h.get("chain") != chain:
        return "superseded"
    if h.get("status") in BATCH_TERMINAL:
        return h["status"]
    queue = h["queue"]
    rt.enqueue_tick(queue, batch_id, chain, delay_s=bs.batch_poll_s)
    now, ingest_until = store.clock(batch_id)
    token = new_token()
    if store.lease(batch_id, LEASE, token, bs.batch_lease_s, beat=f"{now:.6f}") != 1:
        return "another collector is at work (it shows the chain's life)"
    try:
        if h.get("ingested") != "1" and ingest_until < now:
            rearm = new_token()  # the ingest paused or went silent: take its lease
            if store.lease(batch_id, "ingest_lease", rearm, bs.batch_lease_s) == 1:
                if h.get("paused") == "1":  # its window on the lane was full: go on here
                    run_ingest(rt, batch_id, rearm)
                else:
                    rt.enqueue_ingest(queue, batch_id, rearm)
        if h.get("validated") != "1":
            return "validating"
        return Tick(rt, batch_id, token).run(now)
    finally:
        store.release(batch_id, LEASE, token)


class Tick:
    def __init__(self, rt: Runtime, batch_id: str, token: str) -> None:
        self.rt, self.batch_id, self.token = rt, batch_id, token
        self.h = rt.store.get(batch_id)
        self.files = BatchFiles(Path(self.h["folder"]))
        self.manifest = load_manifest(self.files)

    def run(self, now: float) -> str:
        if not self.collect():
            return "lease lost"
        h = self.h = self.rt.store.get(self.batch_id)
        over = now > float(h["expires_at"]) + self.rt.bs.batch_expiry_grace_s
        if h.get("ingested") == "1":
            if h["status"] == S.cancelling and not h.get("cancel_swept"):
                self.sweep("cancel_swept")
            elif over and not h.get("expiry_swept"):
                self.sweep("expiry_swept")
        return self.finalize() or h["status"]

    # -- collect
    def collect(self) -> bool:
        """Move ended jobs from the done list into the files; False if the lease was lost."""
        r, keys, store = self.rt.r, self.rt.bkeys(self.batch_id), self.rt.store
        while True:
            items = r.lrange(keys.batch_done(self.batch_id), 0, COLLECT_CHUNK - 1)
            if not items:
                return True
            # read after the items: a job the batch's cancel ended is seen with "cancelling"
            self.h = store.get(self.batch_id)
            if store.lease(self.batch_id, LEASE, self.token, self.rt.bs.batch_lease_s) != 1:
                return False
            outs, errs, cut = self.shape(items)
            if outs:
                append_rows(self.files.output, outs)
            if errs:
                append_rows(self.files.errors, errs)
            if not self.rt.store.commit(self.batch_id, self.token, len(items), cut,
                                        usage_of(outs)):
                return False
            self.release(items)

    def release(self, items: list[str]) -> None:
        """The collected jobs' lines are in the files: drop their out streams, keep their
        records ``batch_collected_ttl_s`` (a crash before this leaves them their service
        TTL, PAGEDQ_RESULT_TTL_S)."""
        keys, ttl = self.rt.bkeys(self.batch_id), self.rt.bs.batch_collected_ttl_s
        with self.rt.r.pipeline(transaction=False) as pipe:
            for x in items:
                if x.isdigit():
                    jid = L.job_id(self.batch_id, int(x))
                    pipe.delete(keys.out(jid))
                    pipe.expire(keys.job(jid), ttl)
            pipe.execute()

    def shape(self, items: list[str]) -> tuple[list[dict], list[dict], int]:
        r, keys, h = self.rt.r, self.rt.bkeys(self.batch_id), self.h
        found = [(ln, L.job_id(self.batch_id, ln.line)) for ln in
                 (self.manifest.get(int(x)) for x in items if x.isdigit()) if ln is not None]
        with r.pipeline(transaction=False) as pipe:
            for _, jid in found:
                pipe.hgetall(keys.job(jid))
            records = pipe.execute()
        events = self.logprob_events(found, records)
        cancelled = h.get("status") == S.cancelling or bool(h.get("cancelling_at"))
        outs, errs, cut = [], [], 0
        for (ln, jid), rec in zip(found, records, strict=True):
            is_out, row, was_cut = outcome(ln, jid, rec, h["model"], batch_cancelled=cancelled,
                                           expires_at=float(h["expires_at"]),
                                           events=events.get(jid))
            (outs if is_out else errs).append(row)
            cut += was_cut
        return outs, errs, cut

    def logprob_events(self, found: list[tuple[L.Line, str]],
                       records: list[dict[str, str]]) -> dict[str, list[dict[str, str]]]:
        want = [jid for (ln, jid), rec in zip(found, records, strict=True)
                if (ln.logprobs or ln.echo) and rec.get("status") == "finished"]
        if not want:
            return {}
        with self.rt.r.pipeline(transaction=False) as pipe:
            for jid in want:
                pipe.xrange(self.rt.bkeys(self.batch_id).out(jid))
            logs = pipe.execute()
        return {jid: [fields for _, fields in log] for jid, log in zip(want, logs, strict=True)}

    # -- stop what must stop
    def jobs_made(self) -> list[str]:
        """Ids of every job the ingest made: valid lines below the cursor, plus ``extra``."""
        cursor = int(self.h.get("cursor") or 1)
        extra = [int(x) for x in (self.h.get("extra") or "").split(",") if x]
        lines = [n for n in self.manifest if n < cursor] + extra
        return [L.job_id(self.batch_id, n) for n in lines]

    def sweep(self, flag: str) -> None:
        cancel_jobs(self.rt.client, self.jobs_made())
        self.rt.r.hset(self.rt.bkeys(self.batch_id).batch(self.batch_id), flag, 1)

    # -- finalize
    def finalize(self) -> str | None:
        h, store, bs = self.h, self.rt.store, self.rt.bs
        if h.get("ingested") != "1":
            return None
        ended = int(h.get("completed") or 0) + int(h.get("failed") or 0)
        if ended < int(h.get("submitted") or 0) or self.rt.r.llen(
                self.rt.bkeys(self.batch_id).batch_done(self.batch_id)):
            return None
        if h["status"] in (S.validating, S.in_progress):
            store.transition(self.batch_id, (S.validating, S.in_progress), S.finalizing)
        status = store.get(self.batch_id).get("status")
        if status not in (S.finalizing, S.cancelling):
            return status
        out, err = self.final_rows(status == S.cancelling)
        write_rows(self.files.output, out)
        write_rows(self.files.errors, err)
        expired = any((row.get("error") or {}).get("code") == EXPIRED for row in err)
        target = (S.cancelled if status == S.cancelling else S.failed if not self.manifest
                  else S.expired if expired else S.completed)
        extra = {}
        if target == S.failed:  # (normally the ingest ends such a batch, with this list)
            extra["errors"] = json.dumps(errors_object([row["error"] for row in err]))
        store.transition(self.batch_id, (S.finalizing, S.cancelling), target,
                         bs.batch_record_ttl_s, final_completed=len(out), final_failed=len(err),
                         **extra)
        return target

    def final_rows(self, cancelled: bool) -> tuple[list[dict], list[dict]]:
        """The deduplicated rows, every valid line once, sorted by input line."""
        out = list(unique_rows(read_rows(self.files.output)))
        err = list(unique_rows(read_all([self.files.invalid, self.files.errors])))
        seen = {key_of(row) for row in out + err}
        made = set(self.jobs_made())
        for ln in self.manifest.values():
            if ("custom_id", ln.custom_id) in seen:
                continue
            jid = L.job_id(self.batch_id, ln.line)
            if jid in made:  # ended and counted, yet not collected: cannot happen
                row = error_line(ln.custom_id, "result_missing", "the job's result was not "
                                 "collected", job_id=jid)
            elif cancelled:
                row = error_line(ln.custom_id, CANCELLED, "the batch was cancelled before "
                                 "this request was submitted")
            else:
                row = error_line(ln.custom_id, EXPIRED, "the completion window ran out "
                                 "before this request was submitted")
            err.append(row)
        line_of = {ln.custom_id: ln.line for ln in self.manifest.values()}

        def order(row: dict[str, Any]) -> int:
            kind, v = key_of(row)
            return v if kind == "line" else line_of.get(v, 0)
        return sorted(out, key=order), sorted(err, key=order)
