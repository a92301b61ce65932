"""/v1/files and /v1/batches over pagedq's bulk batches (docs/batches.md).

Uploaded files (purpose ``batch``) are written to ``<batch_dir>/uploads/<tenant>/<file
id>.jsonl`` (the batch folder every gateway process and rq worker must share) with a
record in Redis, ``{T}:file:<file id>`` (a hash) and ``{T}:files`` (ids by upload time),
under the tenant's prefix T. An upload expires ``PAGEDQ_GATEWAY_UPLOAD_TTL_S`` after it was
made (its record's TTL; its bytes and index entry go at the tenant's next upload or file
list), and a tenant's live uploads may hold ``PAGEDQ_GATEWAY_UPLOAD_QUOTA_BYTES`` at most
(checked at each upload, once its size is known). A batch made from one (``AsyncBatches.create``) copies it
into its own folder; its output and error files are served as the file ids
``file-<batch id>-output`` and ``file-<batch id>-errors``: the lines so far while the
batch runs, the final files (in input order) once it has ended. The batch's
``input_file_id`` and ``endpoint`` are kept in its record (fields ``openai_input_file_id``,
``openai_endpoint``).
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import FileResponse, Response

from pagedq.batch import Batch, BatchNotFound, BatchStateError
from pagedq.batch.lines import capped_lines
from pagedq.wire.errors import InvalidRequest
from pagedq.wire.keys import Keys
from pagedq.wire.openai_api import ENDPOINTS

from .errors import APIError, bad_request, not_found
from .models import served

RESULT_FILE_RE = re.compile(r"^file-(batch_[0-9a-f]{32})-(output|errors)$")
UPLOAD_ID_RE = re.compile(r"^file-[0-9a-f]{32}$")
_BATCH_TIMES = ("created_at", "in_progress_at", "finalizing_at", "completed_at", "failed_at",
                "expired_at", "cancelling_at", "cancelled_at", "expires_at")


def _file_key(tenant: str, file_id: str) -> str:
    return Keys(tenant).file(file_id)


def _batch_key(gw: Any, tenant: str, batch_id: str) -> str:
    """A batch's record, in the partition its id names (wire/keys.py)."""
    return Keys(tenant).of_job(batch_id, gw.settings.partitions).batch(batch_id)


def _files_key(tenant: str) -> str:
    return Keys(tenant).files


# ---- files
# multipart framing around the file (boundaries, part headers, the purpose field): an
# upload's Content-Length past the file limit plus this is refused before it is read
FORM_OVERHEAD_BYTES = 64 * 1024


async def upload(gw: Any, tenant: str, request: Request) -> dict[str, Any]:
    limit = gw.batch_settings.batch_max_bytes
    size = request.headers.get("content-length", "")
    if size.isdigit() and int(size) > limit + FORM_OVERHEAD_BYTES:  # before reading the body
        raise APIError(413, f"the upload is {int(size)} bytes: a file may have at most {limit} "
                       "bytes (PAGEDQ_BATCH_MAX_BYTES)", "file_too_large", "file")
    form = await request.form(max_files=1)
    try:
        f, purpose = form.get("file"), form.get("purpose")
        if purpose != "batch":
            raise bad_request("purpose must be \"batch\" (the only kind of file this gateway "
                              "keeps)", "purpose")
        if not isinstance(f, UploadFile):
            raise bad_request("a multipart field \"file\" with the JSONL file is required",
                              "file")
        file_id = "file-" + uuid.uuid4().hex
        folder = gw.batch_settings.dir_path() / "uploads" / tenant
        path = folder / f"{file_id}.jsonl"
        info = await asyncio.to_thread(_store, f, folder, path, gw.batch_settings)
    finally:
        await form.close()
    quota, ttl = gw.gateway.upload_quota_bytes, gw.gateway.upload_ttl_s
    used = sum(int(rec.get("bytes") or 0) for _i, rec in await _live_files(gw, tenant))
    if quota and used + info["bytes"] > quota:
        await asyncio.to_thread(path.unlink, True)
        raise bad_request(f"the tenant's uploaded files would hold {used + info['bytes']} "
                          f"bytes, past its quota of {quota} (PAGEDQ_GATEWAY_UPLOAD_QUOTA_BYTES): "
                          "delete files first", "file", "storage_quota_exceeded")
    now = int(time.time())
    rec = {"filename": f.filename or "upload.jsonl", "bytes": info["bytes"],
           "created_at": now, "purpose": "batch", "path": str(path),
           "lines": info["lines"], "models": json.dumps(info["models"]),
           "urls": json.dumps(info["urls"]), "expires_at": now + ttl if ttl else ""}
    r = gw.tenants.client(tenant).redis
    async with r.pipeline(transaction=True) as pipe:
        pipe.hset(_file_key(tenant, file_id), mapping=rec)
        if ttl:
            pipe.expire(_file_key(tenant, file_id), ttl)
        pipe.zadd(_files_key(tenant), {file_id: time.time()})
        await pipe.execute()
    return _file_object(file_id, rec)


async def _live_files(gw: Any, tenant: str) -> list[tuple[str, dict[str, str]]]:
    """The tenant's uploads whose record lives, newest first; those whose record expired
    leave the index and the disk here."""
    r = gw.tenants.client(tenant).redis
    ids = await r.zrevrange(_files_key(tenant), 0, -1)
    async with r.pipeline(transaction=False) as pipe:
        for i in ids:
            pipe.hgetall(_file_key(tenant, i))
        recs = await pipe.execute()
    gone = [i for i, rec in zip(ids, recs, strict=True) if not rec and UPLOAD_ID_RE.match(i)]
    if gone:
        await r.zrem(_files_key(tenant), *gone)
        folder = gw.batch_settings.dir_path() / "uploads" / tenant
        for i in gone:
            await asyncio.to_thread((folder / f"{i}.jsonl").unlink, True)
    return [(i, rec) for i, rec in zip(ids, recs, strict=True) if rec]


def _store(f: UploadFile, folder: Path, path: Path, bs: Any) -> dict[str, Any]:
    """Copy the upload to ``path`` within the batch limits; what its lines ask for."""
    folder.mkdir(parents=True, exist_ok=True)
    size, lines, models, urls = 0, 0, set(), set()
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as out:
            f.file.seek(0)
            for number, raw in enumerate(capped_lines(f.file, bs.batch_max_line_bytes), 1):
                if isinstance(raw, int):  # (never held whole)
                    raise bad_request(f"line {number} is longer than the "
                                      f"limit of {bs.batch_max_line_bytes} bytes a line "
                                      "(PAGEDQ_BATCH_MAX_LINE_BYTES)", "file", "line_too_long")
                size += len(raw)
                if size > bs.batch_max_bytes:
                    raise bad_request(f"the file is larger than {bs.batch_max_bytes} bytes "
                                      "(PAGEDQ_BATCH_MAX_BYTES)", "file", "file_too_large")
                if raw.strip():
                    lines += 1
                    if lines > bs.batch_max_lines:
                        raise bad_request(f"the file has more than {bs.batch_max_lines} lines "
                                          "(PAGEDQ_BATCH_MAX_LINES)", "file", "file_too_large")
                    _note(raw, models, urls)
                out.write(raw)
        if lines == 0:
            raise bad_request("the file has no request lines", "file", "empty_file")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return {"bytes": size, "lines": lines, "models": sorted(models), "urls": sorted(urls)}


def _note(raw: bytes, models: set[str], urls: set[str]) -> None:
    """A line's model and url (a line that is not a request is the batch's to report)."""
    try:
        obj = json.loads(raw)
    except ValueError:
        return
    if isinstance(obj, dict):
        if isinstance(obj.get("url"), str):
            urls.add(obj["url"])
        body = obj.get("body")
        if isinstance(body, dict) and isinstance(body.get("model"), str):
            models.add(body["model"])


async def _batch_model(gw: Any, tenant: str, named: list[str]) -> str:
    """The one model a batch runs: the model its lines name that this deployment serves
    (now or within the models list's window), else the gateway's default model. Lines that
    name another model are the batch's ``model_mismatch`` errors, as with the CLI; a file
    naming two served models is refused (a batch runs one model)."""
    live = await served(gw.tenants.client(tenant))
    mine = [m for m in named if m in live]
    if len(mine) > 1:
        raise bad_request(f"a batch runs one model; the file names {mine}", "input_file_id")
    return mine[0] if mine else gw.settings.model


def _file_object(file_id: str, rec: dict[str, Any]) -> dict[str, Any]:
    return {"id": file_id, "object": "file", "bytes": int(rec.get("bytes") or 0),
            "created_at": int(float(rec.get("created_at") or 0)),
            "filename": rec.get("filename", ""), "purpose": rec.get("purpose", "batch"),
            "status": "processed", "status_details": None,
            "expires_at": int(rec["expires_at"]) if rec.get("expires_at") else None}


async def _upload_record(gw: Any, tenant: str, file_id: str) -> dict[str, str]:
    rec = await gw.tenants.client(tenant).redis.hgetall(_file_key(tenant, file_id)) \
        if UPLOAD_ID_RE.match(file_id) else {}
    if not rec:
        raise not_found(f"no file {file_id!r}", "file_not_found")
    return rec


async def retrieve_file(gw: Any, tenant: str, file_id: str) -> dict[str, Any]:
    if m := RESULT_FILE_RE.match(file_id):
        b = await _batch(gw, tenant, m[1], file_id)
        path = Path(b.output_file if m[2] == "output" else b.error_file)
        size = path.stat().st_size if path.exists() else 0
        return _file_object(file_id, {"bytes": size, "created_at": b.created_at or 0,
                                      "filename": f"{m[2]}.jsonl",
                                      "purpose": "batch_output"})
    return _file_object(file_id, await _upload_record(gw, tenant, file_id))


async def list_files(gw: Any, tenant: str, limit: int) -> dict[str, Any]:
    live = (await _live_files(gw, tenant))[:max(0, min(limit, 10_000))]
    return {"object": "list", "data": [_file_object(i, rec) for i, rec in live],
            "has_more": False}


async def file_content(gw: Any, tenant: str, file_id: str) -> Response:
    if m := RESULT_FILE_RE.match(file_id):
        b = await _batch(gw, tenant, m[1], file_id)
        path = Path(b.output_file if m[2] == "output" else b.error_file)
        if b.done and path.exists():  # final: whole, in input order
            return FileResponse(path, media_type="application/jsonl")
        ab = gw.tenants.batches(tenant)
        rows = await (ab.results(b.id) if m[2] == "output" else ab.errors(b.id))
        return Response("".join(json.dumps(x) + "\n" for x in rows),
                        media_type="application/jsonl")
    rec = await _upload_record(gw, tenant, file_id)
    return FileResponse(rec["path"], media_type="application/jsonl")


async def delete_file(gw: Any, tenant: str, file_id: str) -> dict[str, Any]:
    if RESULT_FILE_RE.match(file_id):
        raise bad_request("a batch's output and error files go with the batch", "file_id")
    rec = await _upload_record(gw, tenant, file_id)
    r = gw.tenants.client(tenant).redis
    async with r.pipeline(transaction=True) as pipe:
        pipe.delete(_file_key(tenant, file_id))
        pipe.zrem(_files_key(tenant), file_id)
        await pipe.execute()
    await asyncio.to_thread(Path(rec["path"]).unlink, True)
    return {"id": file_id, "object": "file", "deleted": True}


# ---- batches

async def create_batch(gw: Any, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
    extra = set(body) - {"input_file_id", "endpoint", "completion_window", "metadata",
                         "output_expires_after"}
    if extra:
        raise bad_request(f"unknown fields {sorted(extra)}", sorted(extra)[0])
    endpoint = body.get("endpoint")
    if endpoint not in ENDPOINTS:
        raise bad_request(f"endpoint must be one of {sorted(ENDPOINTS)}", "endpoint")
    file_id = body.get("input_file_id")
    if not isinstance(file_id, str):
        raise bad_request("input_file_id is required", "input_file_id")
    rec = await _upload_record(gw, tenant, file_id)
    others = set(json.loads(rec.get("urls") or "[]")) - {endpoint}
    if others:
        raise bad_request(f"the file has lines for {sorted(others)}, not the batch's endpoint "
                          f"{endpoint}", "input_file_id")
    model = await _batch_model(gw, tenant, json.loads(rec.get("models") or "[]"))
    meta = body.get("metadata")
    if meta is not None and not isinstance(meta, dict):
        raise bad_request("metadata must be an object of strings", "metadata")
    ab = gw.tenants.batches(tenant)
    try:
        b = await ab.create(rec["path"], model=model,
                            completion_window=body.get("completion_window") or None,
                            metadata=meta)
    except InvalidRequest as e:
        raise bad_request(str(e)) from None
    await gw.tenants.client(tenant).redis.hset(
        _batch_key(gw, tenant, b.id), mapping={"openai_input_file_id": file_id,
                                           "openai_endpoint": endpoint})
    return await batch_object(gw, tenant, b)


async def _batch(gw: Any, tenant: str, batch_id: str, what: str | None = None) -> Batch:
    try:
        return await gw.tenants.batches(tenant).retrieve(batch_id)
    except BatchNotFound:
        raise not_found(f"no {'file' if what else 'batch'} {what or batch_id!r}",
                        "file_not_found" if what else "batch_not_found") from None


async def retrieve_batch(gw: Any, tenant: str, batch_id: str) -> dict[str, Any]:
    return await batch_object(gw, tenant, await _batch(gw, tenant, batch_id))


async def cancel_batch(gw: Any, tenant: str, batch_id: str) -> dict[str, Any]:
    try:
        b = await gw.tenants.batches(tenant).cancel(batch_id)
    except BatchNotFound:
        raise not_found(f"no batch {batch_id!r}", "batch_not_found") from None
    except BatchStateError as e:
        raise APIError(409, str(e), "batch_state") from None
    return await batch_object(gw, tenant, b)


async def list_batches(gw: Any, tenant: str, limit: int) -> dict[str, Any]:
    bs = await gw.tenants.batches(tenant).list(max(1, min(limit, 100)))
    data = [await batch_object(gw, tenant, b) for b in bs]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": False}


async def batch_object(gw: Any, tenant: str, b: Batch) -> dict[str, Any]:
    """pagedq's batch in OpenAI's Batch shape (plus ``model``)."""
    file_id, endpoint = await gw.tenants.client(tenant).redis.hmget(
        _batch_key(gw, tenant, b.id), "openai_input_file_id", "openai_endpoint")
    rc = b.request_counts
    return {"id": b.id, "object": "batch", "endpoint": endpoint or "", "model": b.model,
            "errors": b.errors, "input_file_id": file_id or "",
            "completion_window": b.completion_window, "status": b.status.value,
            "output_file_id": f"file-{b.id}-output", "error_file_id": f"file-{b.id}-errors",
            **{t: getattr(b, t) for t in _BATCH_TIMES},
            "request_counts": {"total": rc.total, "completed": rc.completed,
                               "failed": rc.failed},
            "usage": {"input_tokens": b.usage.input_tokens,
                      "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": b.usage.output_tokens,
                      "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": b.usage.total_tokens},
            "metadata": b.metadata}

