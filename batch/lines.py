"""OpenAI Batch JSONL lines -> pagedq job requests (pure: no Redis, no files).

One input line is ``{"custom_id", "method": "POST", "url", "body"}``. ``url`` picks the
shape: ``/v1/completions`` (``prompt``: a string or token ids) or ``/v1/chat/completions``
(``messages``). The body is validated by ``JobRequest`` (which accepts OpenAI's aliases:
max_completion_tokens, logprobs + top_logprobs, user). A bad line becomes a ``LineError``
with its line number and custom_id; it never fails the other lines.

Invariant: parsing is deterministic. The ingest validates the file once, then re-parses
each line when it submits it (after a crash, again): the same line gives the same body,
so a resubmitted job is recognised by SUBMIT's idempotency check.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

from pydantic import ValidationError

from pagedq.wire.openai_api import ENDPOINTS, FieldError, shape
from pagedq.wire.schema import JobRequest, describe

LANE = "batch"  # the jobs stream lane every batch job rides
# bytes of one line without its newline (PAGEDQ_BATCH_MAX_LINE_BYTES's default: the
# gateway's request body limit)
MAX_LINE_BYTES = 8 * 1024 * 1024
# set by the batch for every line, refused in a body
BATCH_FIELDS = ("id", "lane", "timeout_s", "v")
# codes of the error file for lines that never became jobs because they are invalid
VALIDATION_CODES = frozenset({"line_too_long", "invalid_json_line", "invalid_custom_id", "duplicate_custom_id",
                              "invalid_method", "invalid_url", "model_mismatch",
                              "invalid_request"})


@dataclass(frozen=True, slots=True)
class LineError:
    line: int  # 1-based line number in the input file
    custom_id: str | None
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class Line:
    """A valid line: what the collector needs to shape its result."""

    line: int
    custom_id: str
    kind: str  # "completion" or "chat"
    logprobs: bool  # the request asked for log-probabilities
    tools: bool = False  # its tools were active: its output may be calls (wire/tools.py)
    echo: bool = False  # a completion's echo: its prompt (from its event 0) before its text

    def row(self) -> list[Any]:
        return [self.line, self.custom_id, self.kind, self.logprobs, self.tools, self.echo]

    @classmethod
    def from_row(cls, row: list[Any]) -> Line:
        # rows written before tools (echo) existed have four (five) fields
        return cls(int(row[0]), str(row[1]), str(row[2]), bool(row[3]),
                   bool(row[4]) if len(row) > 4 else False,
                   bool(row[5]) if len(row) > 5 else False)


@dataclass(frozen=True, slots=True)
class Parsed:
    line: int
    custom_id: str
    kind: str
    data: dict[str, Any]  # JobRequest fields, without id, lane, timeout_s
    echo: bool = False


def job_id(batch_id: str, line: int) -> str:
    """Deterministic: a re-run ingest submits the same ids, and SUBMIT answers 'exists'."""
    return f"{batch_id}.{line}"


def capped_lines(f: BinaryIO, max_bytes: int) -> Iterator[bytes | int]:
    """The lines of ``f``, each read with a cap: one longer than ``max_bytes`` (without its
    newline) is read on in 1 MiB pieces that are dropped, and comes as its length (an int),
    so that no line past the cap is ever held whole."""
    while True:
        raw = f.readline(max_bytes + 1)
        if not raw:
            return
        if len(raw) <= max_bytes or raw.endswith(b"\n"):
            yield raw
            continue
        size = len(raw)
        while raw and not raw.endswith(b"\n"):
            raw = f.readline(1 << 20)
            size += len(raw)
        yield size


def read_lines(f: BinaryIO, start_line: int = 1,
               max_bytes: int = MAX_LINE_BYTES) -> Iterator[tuple[int, int, bytes | None]]:
    """(line number, byte offset of the next line, raw line) of the non-blank lines from
    the current position of ``f`` (which is at the start of line ``start_line``); the raw
    line is None for a line longer than ``max_bytes`` (``capped_lines``)."""
    n, offset = start_line - 1, f.tell()
    for raw in capped_lines(f, max_bytes):
        n += 1
        if isinstance(raw, int):
            offset += raw
            yield n, offset, None
            continue
        offset += len(raw)
        if raw.strip():
            yield n, offset, raw


def parse(raw: bytes, line: int, model: str) -> Parsed | LineError:
    """One line -> the request fields, or why it is invalid (custom_id checks excepted:
    duplicates are the file's business, see ``Validator``)."""
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        return LineError(line, None, "invalid_json_line", f"not a JSON line: {e}")
    if not isinstance(obj, dict):
        return LineError(line, None, "invalid_json_line", "a line must be a JSON object")
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return LineError(line, None, "invalid_custom_id", "custom_id must be a non-empty string")
    extra = set(obj) - {"custom_id", "method", "url", "body"}
    if extra:
        return LineError(line, cid, "invalid_json_line", f"unknown fields {sorted(extra)}")
    if obj.get("method") != "POST":
        return LineError(line, cid, "invalid_method", "method must be \"POST\"")
    kind = ENDPOINTS.get(obj.get("url"))  # type: ignore[arg-type]
    if kind is None:
        return LineError(line, cid, "invalid_url", f"url must be one of {sorted(ENDPOINTS)}")
    body = obj.get("body")
    if not isinstance(body, dict):
        return LineError(line, cid, "invalid_request", "body must be a JSON object")
    data = dict(body)
    body_model = data.pop("model", None)
    if body_model is not None and body_model != model:
        return LineError(line, cid, "model_mismatch",
                         f"body model {body_model!r} is not the batch's model {model!r}")
    problem = _shape_problem(kind, data)
    if isinstance(problem, str):
        return LineError(line, cid, "invalid_request", problem)
    return Parsed(line, cid, kind, data, problem)


def _shape_problem(kind: str, data: dict[str, Any]) -> str | bool:
    """Checks JobRequest cannot make: a batch's own (no stream, no fields the batch sets,
    one prompt), then the endpoint's (wire/openai_api.py, shared with the HTTP gateway);
    the line's ``echo`` if it passes."""
    if data.pop("stream", False) not in (False, None):
        return "stream is not supported in a batch"
    for name in BATCH_FIELDS:
        if name in data:
            return f"{name} is set by the batch, not by a line"
    try:
        sh = shape(kind, data)
    except FieldError as e:
        return str(e)
    if len(sh.prompts) != 1:
        return ("prompt: one prompt per batch line (a list of several is served by the "
                "gateway's /v1/completions)")
    if sh.prompts[0] is not None:
        data["prompt"] = sh.prompts[0]
    return sh.echo


def request(p: Parsed, batch_id: str, model: str,
            timeout_s: float | None = None) -> JobRequest | LineError:
    """The job request of a parsed line (``timeout_s``: seconds left in the window)."""
    data = {**p.data, "id": job_id(batch_id, p.line), "model": model, "lane": LANE}
    if timeout_s is not None:
        data["timeout_s"] = timeout_s
    try:
        req = JobRequest.model_validate(data)
        req.check_output()
    except ValidationError as e:
        return LineError(p.line, p.custom_id, "invalid_request", describe(e))
    except ValueError as e:  # a guided spec or a tool's parameters that cannot compile
        return LineError(p.line, p.custom_id, "invalid_request", str(e))
    return req


class Validator:
    """Validates a file's lines in order; a custom_id is claimed by its first line, later
    lines with it are ``duplicate_custom_id`` (OpenAI refuses such files)."""

    def __init__(self, batch_id: str, model: str) -> None:
        self.batch_id, self.model = batch_id, model
        self.seen: set[str] = set()

    def check(self, raw: bytes | None, line: int, max_bytes: int = 0) -> Line | LineError:
        """``raw`` None: a line longer than ``max_bytes`` (read_lines), never read whole."""
        if raw is None:
            return LineError(line, None, "line_too_long",
                             f"the line is longer than the limit of {max_bytes} bytes "
                             "(PAGEDQ_BATCH_MAX_LINE_BYTES)")
        p = parse(raw, line, self.model)
        cid = p.custom_id
        if cid is not None:
            if cid in self.seen:
                return LineError(line, cid, "duplicate_custom_id",
                                 f"custom_id {cid!r} was used by an earlier line")
            self.seen.add(cid)
        if isinstance(p, LineError):
            return p
        req = request(p, self.batch_id, self.model)
        if isinstance(req, LineError):
            return req
        return Line(line, p.custom_id, p.kind, req.logprobs is not None, req.tools_active,
                    p.echo)
