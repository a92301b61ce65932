"""A batch's folder: ``<batch_dir>/<batch id>/`` holds

    input.jsonl     the submitted file, copied at submit (so it cannot change under the batch)
    manifest.jsonl  one row per valid line: [line, custom_id, kind, logprobs] (the ingest)
    invalid.jsonl   an error line per invalid line (the ingest)
    output.jsonl    a line per request that finished (appended as jobs end, final at the end)
    errors.jsonl    a line per request that did not: appended as jobs end; at the end, every
                    error line (invalid.jsonl's too), in input order

The ingest writes only its own files (manifest, invalid): a stale ingest re-validating
can never overwrite what the collector appended. While a batch runs, its error lines are
invalid.jsonl + errors.jsonl (``error_sources``).

Crash safety: whole files are written to a temporary name and renamed. Appends are made
by one collector at a time (the tick lease); a collector first cuts a partial last line
left by a crash (its items are still in Redis and are written again). A crash between an
append and the Redis trim writes a line twice: readers and the finalizer keep the first
line of each request (``key_of``).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedq.wire.errors import InvalidRequest

from .lines import MAX_LINE_BYTES, capped_lines


@dataclass(frozen=True, slots=True)
class BatchFiles:
    folder: Path

    @property
    def input(self) -> Path:
        return self.folder / "input.jsonl"

    @property
    def manifest(self) -> Path:
        return self.folder / "manifest.jsonl"

    @property
    def invalid(self) -> Path:
        return self.folder / "invalid.jsonl"

    @property
    def output(self) -> Path:
        return self.folder / "output.jsonl"

    @property
    def errors(self) -> Path:
        return self.folder / "errors.jsonl"


def copy_input(src: Path, dst: Path, max_bytes: int, max_lines: int,
               max_line_bytes: int = MAX_LINE_BYTES) -> tuple[int, int, str]:
    """Copy ``src`` to ``dst`` -> (bytes, non-blank lines, sha256); InvalidRequest (nothing
    left behind) past the limits, checked as it reads: the file's size first (from the
    file system), each line with the line cap (``capped_lines``)."""
    h, size, lines, number = hashlib.sha256(), 0, 0, 0
    tmp = dst.with_name(dst.name + ".tmp")
    try:
        if src.stat().st_size > max_bytes:
            raise InvalidRequest(f"{src}: larger than the limit of {max_bytes} bytes "
                                 "(PAGEDQ_BATCH_MAX_BYTES)")
        with open(src, "rb") as fin, open(tmp, "wb") as fout:
            for raw in capped_lines(fin, max_line_bytes):
                number += 1
                if isinstance(raw, int):
                    raise InvalidRequest(f"{src}: line {number} is {raw} bytes, longer than the "
                                         f"limit of {max_line_bytes} bytes a line "
                                         "(PAGEDQ_BATCH_MAX_LINE_BYTES)")
                size += len(raw)
                if size > max_bytes:
                    raise InvalidRequest(f"{src}: larger than the limit of "
                                         f"{max_bytes} bytes (PAGEDQ_BATCH_MAX_BYTES)")
                if raw.strip():
                    lines += 1
                    if lines > max_lines:
                        raise InvalidRequest(f"{src}: more than the limit of {max_lines} "
                                             "lines (PAGEDQ_BATCH_MAX_LINES)")
                h.update(raw)
                fout.write(raw)
            _sync(fout)
        if lines == 0:
            raise InvalidRequest(f"{src}: no request lines")
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return size, lines, h.hexdigest()


def write_rows(path: Path, rows: Iterable[Any]) -> int:
    """Replace ``path`` with one JSON line per row, atomically; returns the row count."""
    tmp = path.with_name(path.name + ".tmp")
    n = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(dumps(row) + "\n")
            n += 1
        _sync(f)
    os.replace(tmp, path)
    return n


def append_rows(path: Path, rows: list[Any]) -> None:
    """Append rows (the caller holds the batch's tick lease: one writer)."""
    with open(path, "ab") as f:
        end = f.seek(0, os.SEEK_END)
        keep = _complete_size(path, end)
        if keep < end:  # cut a partial last line a crash left behind
            f.truncate(keep)
        f.write("".join(dumps(row) + "\n" for row in rows).encode("utf-8"))
        _sync(f)


def _complete_size(path: Path, end: int) -> int:
    """Bytes of ``path`` up to and including its last newline."""
    with open(path, "rb") as r:
        pos = end
        while pos > 0:
            start = max(0, pos - 65536)
            r.seek(start)
            block = r.read(pos - start)
            if pos == end and block.endswith(b"\n"):
                return end
            cut = block.rfind(b"\n")
            if cut >= 0:
                return start + cut + 1
            pos = start
    return 0


def read_rows(path: Path) -> Iterator[Any]:
    """The complete JSON lines of ``path`` (none if it does not exist); a partial last
    line (being written, or left by a crash) is skipped."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return
    with f:
        for raw in f:
            if not raw.endswith(b"\n"):
                return
            if raw.strip():
                yield json.loads(raw)


def key_of(row: dict[str, Any]) -> tuple[str, Any]:
    """A request's identity in the output and error files: its custom_id, or for an
    invalid line (whose custom_id may be missing or a duplicate) its line number."""
    err = row.get("error") or {}
    if "line" in err:
        return "line", err["line"]
    return "custom_id", row.get("custom_id")


def unique_rows(rows: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    seen: set[tuple[str, Any]] = set()
    for row in rows:
        k = key_of(row)
        if k not in seen:
            seen.add(k)
            yield row


def error_sources(error_file: Path) -> list[Path]:
    """The files holding a batch's error lines (invalid.jsonl beside errors.jsonl)."""
    return [error_file.with_name("invalid.jsonl"), error_file]


def read_all(paths: Iterable[Path]) -> Iterator[Any]:
    for p in paths:
        yield from read_rows(p)


def export(src: Path | list[Path], dst: Path | None, out: Any = None) -> int:
    """The requests of ``src`` (a file or files) once each, to ``dst`` (atomically) or to
    the text stream ``out``; returns how many."""
    rows = unique_rows(read_all(src if isinstance(src, list) else [src]))
    if dst is not None:
        return write_rows(dst, rows)
    n = 0
    for row in rows:
        out.write(dumps(row) + "\n")
        n += 1
    return n


def remove(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)


def dumps(row: Any) -> str:
    return json.dumps(row, separators=(",", ":"))  # ASCII: safe for any custom_id


def _sync(f: Any) -> None:
    f.flush()
    os.fsync(f.fileno())
