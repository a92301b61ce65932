"""Request preparation, shared by Client and AsyncClient: a submit() call or a request
object -> a validated JobRequest with an id; a pipeline's SUBMIT replies -> job ids or the
first error (the scripts' calls themselves: pagedq.wire.scripts)."""
from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from pagedq.wire.errors import InvalidRequest
from pagedq.wire.keys import check_job_id, new_job_id
from pagedq.wire.schema import JobRequest, describe


def validate_request(data: dict[str, Any] | JobRequest) -> JobRequest:
    """Validate (again, if already a model: it may have been built unvalidated), and
    compile its guided or tools' output spec (llguidance, no torch: a spec that cannot
    compile is refused here, before anything is queued)."""
    if isinstance(data, JobRequest):
        data = data.model_dump(exclude_none=True)
    try:
        req = JobRequest.model_validate(data)
        req.check_output()
    except ValidationError as e:
        raise InvalidRequest("invalid job request: " + describe(e)) from None
    except ValueError as e:
        raise InvalidRequest(f"invalid job request: {e}") from None
    return req


def build_request(prompt: str | list[int] | None, messages: list[Any] | None, model: str,
                  job_id: str | None, explicit: dict[str, Any],
                  params: dict[str, Any], partitions: int = 1) -> JobRequest:
    """``explicit`` are the named keyword arguments (None = the schema default); ``params``
    are passed through as given, so an unknown field is rejected rather than dropped. No
    ``job_id``: a new one (``new_job_id``: in a random one of ``partitions``)."""
    data: dict[str, Any] = {k: v for k, v in explicit.items() if v is not None}
    data.update(params)
    if prompt is not None:
        data["prompt"] = prompt
    if messages is not None:
        data["messages"] = messages
    data["model"] = model
    data["id"] = job_id if job_id is not None else new_job_id(partitions)
    return validate_request(data)


def with_id(req: JobRequest | dict[str, Any], default_model: str,
            partitions: int = 1) -> JobRequest:
    """The request with an id (``new_job_id(partitions)`` if unset) and the client's model
    if the request did not name one, validated."""
    if isinstance(req, JobRequest):
        named_model = "model" in req.model_fields_set
        req = req.model_dump(exclude_none=True)
        if not named_model:
            req["model"] = default_model
    if not isinstance(req, dict):
        raise InvalidRequest(f"expected a JobRequest or a dict, got {type(req).__name__}")
    req = dict(req)
    req.setdefault("model", default_model)
    if req.get("id") is None:
        req["id"] = new_job_id(partitions)
    return validate_request(req)


def checked_id(job_id: str) -> str:
    try:
        return check_job_id(job_id)
    except ValueError as e:
        raise InvalidRequest(str(e)) from None


def collect_replies(results: list[Any]) -> list[str]:
    """The job ids of a pipeline of SUBMITs (``pagedq.wire.script.pipelined``: an id, or
    the error in its place); the first error is raised with ``.job_ids`` (None where
    refused)."""
    ids = [None if isinstance(x, Exception) else x for x in results]
    first = next((x for x in results if isinstance(x, Exception)), None)
    if first is not None:
        first.job_ids = ids  # type: ignore[attr-defined]
        raise first
    return ids  # type: ignore[return-value]
