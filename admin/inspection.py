"""What ``pagedq inspect`` shows: every model's lanes (queue depth, pending entries, dead
letters) and the live workers, read from Redis in a few pipelined round trips.

A snapshot is a plain JSON-able dict (its shape: docs/protocol.md "Inspecting a
deployment and dead letters"); admin/inspect_text.py renders it as tables. Reads only:
inspecting never changes the queue. Ages are measured against Redis ``TIME``, the clock
every script uses; a worker's heartbeat ``at`` is its own clock, so skew between hosts
shows in ``beat_s``.

Models are the members of ``{P}:models`` plus any model that has a jobs or DLQ stream or
an inbox (found by SCAN: an admin command may walk the keyspace; the hot paths never do).
Lanes of a model are this deployment's ``settings.lanes`` plus any other lane with one.
A lane's ``stream_length`` counts its unfinished jobs: those in its jobs stream and those
still in its inbox (``inbox``: submitted, not yet moved into the stream by a worker).

With several partitions every partition is read and a lane's figures are their sums (its
oldest pending entries and newest dead letters: the oldest / newest of all partitions,
each with its ``partition``); workers and serving sets are partition 0's.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import redis

from pagedq.wire.errors import PagedqError
from pagedq.wire.keys import GROUP, Keys, check_lane, check_name

from .dlq import DeadEntry, redis_now

SNAPSHOT_VERSION = 1


class ModelNotFound(PagedqError, KeyError):
    """No model of that name: not in ``{P}:models`` and no stream of it exists."""


def _scan_model_lanes(r: redis.Redis, pattern_base: str) -> Iterable[tuple[str, str]]:
    """(model, lane) of every key ``<pattern_base><model>:<lane>``; other keys are skipped."""
    for key in r.scan_iter(match=pattern_base + "*", count=1000):
        parts = key[len(pattern_base):].split(":")
        if len(parts) != 2:
            continue
        try:
            yield check_name("model", parts[0]), check_lane(parts[1])
        except ValueError:
            continue


def model_lanes(r: redis.Redis, keys: Keys, lanes: tuple[str, ...],
                model: str | None = None, partitions: int = 1) -> dict[str, list[str]]:
    """Model -> its lanes (``lanes`` first, then any other lane that has a jobs or DLQ
    stream, sorted) in any of ``partitions``. ``model``: only that one (ModelNotFound if
    it is nowhere)."""
    found: dict[str, set[str]] = {}
    for k in keys.spaces(partitions):
        found.update((m, found.get(m, set())) for m in r.smembers(k.models))
        for kind in ("jobs", "inbox", "dlq"):
            for m, lane in _scan_model_lanes(r, f"{k.base}:{kind}:"):
                found.setdefault(m, set()).add(lane)
    if model is not None:
        check_name("model", model)
        if model not in found:
            known = ", ".join(sorted(found)) or "none"
            raise ModelNotFound(f"model not found: {model} (known: {known})")
        found = {model: found[model]}
    return {m: list(lanes) + sorted(extra - set(lanes)) for m, extra in sorted(found.items())}


def _ok(x: Any, default: Any) -> Any:
    """A pipelined reply, or ``default`` where Redis answered an error (NOGROUP: a lane
    without a stream or group yet)."""
    return default if isinstance(x, Exception) else x


_READS = 8  # the replies of one lane's reads


def _lane_reads(pipe: Any, keys: Keys, model: str, lane: str, count: int) -> None:
    stream = keys.jobs(model, lane)
    pipe.get(keys.queued_jobs(model, lane))
    pipe.get(keys.queued_tokens(model, lane))
    pipe.xlen(stream)
    pipe.xpending(stream, GROUP)
    pipe.xpending_range(stream, GROUP, min="-", max="+", count=count)
    pipe.xlen(keys.dlq(model, lane))
    pipe.xrevrange(keys.dlq(model, lane), count=count)
    pipe.llen(keys.inbox(model, lane))


def _lane_view(model: str, lane: str, replies: list[Any], now: float,
               partition: int = 0) -> dict[str, Any]:
    qjobs, qtokens, length, summary, oldest, dlq_len, dlq, inbox = replies
    summary = _ok(summary, None) or {}
    view = {
        "lane": lane,
        "queued": int(_ok(qjobs, None) or 0),
        "queued_tokens": int(_ok(qtokens, None) or 0),
        "stream_length": int(_ok(length, 0)) + int(_ok(inbox, 0)),
        "inbox": int(_ok(inbox, 0)),
        "pending": int(summary.get("pending") or 0),
        "pending_by_consumer": {c["name"]: int(c["pending"])
                                for c in summary.get("consumers") or []},
        "oldest_pending": [{"entry": p["message_id"], "job": "", "consumer": p["consumer"],
                            "idle_s": round(p["time_since_delivered"] / 1000, 3),
                            "deliveries": int(p["times_delivered"])}
                           for p in _ok(oldest, [])],
        "dlq_length": int(_ok(dlq_len, 0)),
        "dlq": [DeadEntry.of(model, lane, eid, f, partition).to_json(now)
                for eid, f in _ok(dlq, [])],
    }
    if partition:
        for p in view["oldest_pending"]:
            p["partition"] = partition
    return view


def _merged(views: list[dict[str, Any]], count: int) -> dict[str, Any]:
    """One lane's views of every partition as one: sums; the ``count`` oldest pending
    entries and newest dead letters of all."""
    out = views[0]
    if len(views) == 1:
        return out
    for v in views[1:]:
        for name in ("queued", "queued_tokens", "stream_length", "inbox", "pending",
                     "dlq_length"):
            out[name] += v[name]
        for c, n in v["pending_by_consumer"].items():
            out["pending_by_consumer"][c] = out["pending_by_consumer"].get(c, 0) + n
        out["oldest_pending"] += v["oldest_pending"]
        out["dlq"] += v["dlq"]
    out["oldest_pending"] = sorted(out["oldest_pending"], key=lambda p: -p["idle_s"])[:count]
    out["dlq"] = sorted(out["dlq"], key=lambda d: tuple(map(int, d["id"].split("-"))),
                        reverse=True)[:count]
    return out


def _worker_view(wid: str, h: dict[str, str], last: float, serving: bool,
                 now: float) -> dict[str, Any]:
    def num(name: str, kind: type = float) -> Any:
        try:
            return kind(h[name])
        except (KeyError, ValueError):
            return None
    at, started = num("at"), num("started_at")
    return {
        "worker": wid, "model": h.get("model", ""), "device": h.get("device", ""),
        "running": num("running", int), "max_num_seqs": num("max_num_seqs", int),
        "kv_usage": num("kv_usage"),
        "jobs": [j for j in h.get("jobs", "").split(",") if j],
        "beat_s": round(now - (at if at is not None else last), 3),
        "uptime_s": None if started is None else round(now - started, 1),
        "serving": serving,
    }


def snapshot(r: redis.Redis, keys: Keys, lanes: tuple[str, ...], model: str | None = None,
             count: int = 5, partitions: int = 1) -> dict[str, Any]:
    """The deployment now (docs/protocol.md "Inspecting a deployment and dead letters"):
    per model and lane the queue and the ``count`` oldest pending / newest dead entries
    (over ``partitions``), and the workers.
    ``model``: only that model and its workers."""
    keys = keys.home
    spaces = keys.spaces(partitions)
    models = model_lanes(r, keys, lanes, model, partitions)
    now = redis_now(r)
    beats = dict(r.zrange(keys.workers, 0, -1, withscores=True))
    pipe = r.pipeline(transaction=False)
    for m, ls in models.items():
        pipe.zrange(keys.serving(m), 0, -1, withscores=True)
        for lane in ls:
            for k in spaces:
                _lane_reads(pipe, k, m, lane, count)
    for wid in beats:
        pipe.hgetall(keys.worker(wid))
    replies = pipe.execute(raise_on_error=False)
    out_models, i = [], 0
    serving: dict[str, set[str]] = {}  # live members (expiry scores not yet past)
    listed: set[str] = set()  # every member, live or not, of the serving sets read
    for m, ls in models.items():
        members = dict(_ok(replies[i], []))
        serving[m] = {w for w, expiry in members.items() if expiry >= now}
        listed |= members.keys()
        i += 1
        views = []
        for lane in ls:
            per = []
            for k in spaces:
                per.append(_lane_view(m, lane, replies[i:i + _READS], now, k.partition))
                i += _READS
            views.append(_merged(per, count))
        out_models.append({"model": m, "served_by": len(serving[m]), "lanes": views})
    workers, silent = [], []
    for wid, h in zip(beats, replies[i:], strict=True):
        h = _ok(h, {})
        if model is not None and (h.get("model") != model if h else wid not in listed):
            continue
        if not h:  # its heartbeat key expired: dead, or wedged; pruned after an hour
            silent.append({"worker": wid, "beat_s": round(now - beats[wid], 3)})
            continue
        workers.append(_worker_view(wid, h, beats[wid], wid in serving.get(h.get("model"), ()),
                                    now))
    _fill_pending_jobs(r, keys, out_models)
    snap = {"v": SNAPSHOT_VERSION, "prefix": keys.prefix, "at": now, "models": out_models,
            "workers": workers, "silent_workers": silent}
    if partitions > 1:
        snap["partitions"] = partitions
    return snap


def _fill_pending_jobs(r: redis.Redis, keys: Keys, models: list[dict[str, Any]]) -> None:
    """The job id of each listed pending entry (XPENDING names only the entry)."""
    rows = [(m["model"], lane["lane"], p) for m in models for lane in m["lanes"]
            for p in lane["oldest_pending"]]
    if not rows:
        return
    pipe = r.pipeline(transaction=False)
    for m, lane, p in rows:
        stream = keys.part(p.get("partition", 0)).jobs(m, lane)
        pipe.xrange(stream, p["entry"], p["entry"])
    for (_m, _lane, p), got in zip(rows, pipe.execute(raise_on_error=False), strict=True):
        got = _ok(got, [])
        p["job"] = got[0][1].get("job", "") if got else ""  # gone: it ended meanwhile
