"""Human output of ``pagedq inspect`` and ``pagedq dlq list``: compact aligned tables of a
snapshot (admin/inspection.py) or of dead entries. The columns are explained in
docs/protocol.md "Inspecting a deployment and dead letters"; ``--json`` prints the data."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .dlq import clean

REASON_CHARS = 70  # a reason is cut to this in a table (--json has it whole)
JOBS_CHARS = 60  # the running job ids of a worker, cut to this


def age(s: float | None) -> str:
    if s is None:
        return "-"
    s = max(s, 0.0)
    if s < 60:
        return f"{s:.1f}s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    if s < 86400:
        return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"
    return f"{int(s // 86400)}d{int(s % 86400 // 3600):02d}h"


def cut(text: str, n: int) -> str:
    text = " ".join(clean(text).split())
    return text if len(text) <= n else text[:n - 3] + "..."


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str) -> list[str]:
    """Columns padded to their widest cell; ``align``: one 'l' or 'r' per column. The last
    column is not padded (no trailing blanks)."""
    cells = [list(map(str, headers))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    out = []
    for r in cells:
        parts = [c.rjust(w) if a == "r" else c.ljust(w)
                 for c, w, a in zip(r[:-1], widths, align, strict=False)]
        out.append("  ".join([*parts, r[-1].rjust(widths[-1]) if align[-1] == "r" else r[-1]]))
    return out


def _jobs(ids: list[str], running: int | None) -> str:
    text, more = ",".join(clean(j) for j in ids), (running or 0) - len(ids)
    text = cut(text, JOBS_CHARS) if text else "-"
    return text + (f" (+{more})" if more > 0 else "")


def dead_rows(entries: list[dict[str, Any]]) -> list[list[Any]]:
    return [[d["model"], d["lane"], d["id"], cut(d["job"], 40) or "-",
             "-" if d["deliveries"] is None else d["deliveries"], age(d["age_s"]),
             "yes" if d["requeueable"] else f"no: {d['problem']}",
             cut(d["reason"], REASON_CHARS)] for d in entries]


DEAD_HEADERS = ("MODEL", "LANE", "ENTRY", "JOB", "DELIVERIES", "AGE", "REQUEUE", "REASON")
DEAD_ALIGN = "llllrrll"


def render(snap: dict[str, Any], count: int) -> str:
    lines: list[str] = []
    models = snap["models"]
    lanes = [(m, ln) for m in models for ln in m["lanes"]]
    lines.append(f"prefix {snap['prefix']}: {len(models)} model(s), "
                 f"{len(snap['workers'])} live worker(s)")
    if lanes:
        lines += ["", "QUEUES"] + table(
            ("MODEL", "LANE", "QUEUED", "TOKENS", "STREAM", "PENDING", "OLDEST-IDLE", "DLQ",
             "WORKERS"),
            [[m["model"], ln["lane"], ln["queued"], ln["queued_tokens"], ln["stream_length"],
              ln["pending"], age(ln["oldest_pending"][0]["idle_s"]) if ln["oldest_pending"]
              else "-", ln["dlq_length"], m["served_by"]] for m, ln in lanes],
            "llrrrrrrr")
    pending = [[m["model"], ln["lane"], p["entry"], cut(p["job"], 40) or "-", p["consumer"],
                age(p["idle_s"]), p["deliveries"]]
               for m, ln in lanes for p in ln["oldest_pending"]]
    if pending:
        lines += ["", f"PENDING (oldest {count} per lane)"] + table(
            ("MODEL", "LANE", "ENTRY", "JOB", "CONSUMER", "IDLE", "DELIVERIES"), pending,
            "lllllrr")
    dead = [d for _m, ln in lanes for d in ln["dlq"]]
    if dead:
        lines += ["", f"DEAD LETTERS (newest {count} per lane; pagedq dlq list)"]
        lines += table(DEAD_HEADERS, dead_rows(dead), DEAD_ALIGN)
    lines += ["", "WORKERS"]
    if snap["workers"]:
        lines += table(
            ("WORKER", "MODEL", "DEVICE", "RUNNING", "KV", "BEAT", "UPTIME", "JOBS"),
            [[w["worker"], w["model"], w["device"] or "-",
              f"{w['running']}/{w['max_num_seqs']}" if w["max_num_seqs"] else w["running"],
              "-" if w["kv_usage"] is None else f"{100 * w['kv_usage']:.1f}%",
              age(w["beat_s"]), age(w["uptime_s"]), _jobs(w["jobs"], w["running"])]
             for w in snap["workers"]], "lllrrrrl")
    else:
        lines.append("no live worker")
    if snap["silent_workers"]:
        lines.append("silent (heartbeat expired; dropped after 1 h): " + ", ".join(
            f"{w['worker']} ({age(w['beat_s'])} ago)" for w in snap["silent_workers"]))
    return "\n".join(lines)
