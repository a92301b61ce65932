"""Turning a jobs-stream entry into engine input (validation at the boundary)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from pydantic import ValidationError

from engine.sampling_params import SamplingParams
from producer.keys import JOB_ID_RE
from producer.schema import JobRequest


class BadEntry(ValueError):
    """An entry that can never run; ``job_id`` is set when it names a usable job id."""

    def __init__(self, reason: str, job_id: str = "") -> None:
        super().__init__(reason)
        self.job_id = job_id


@dataclass(slots=True)
class Job:
    """A job this worker owns (running in the engine)."""

    job_id: str
    entry_id: str
    attempt: int
    request: JobRequest
    deadline: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    text: list[str] = field(default_factory=list)
    admitted_at: float = 0.0  # time.monotonic() at admission
    last_token_at: float | None = None


def parse_entry(fields: dict[str, str]) -> JobRequest:
    """Validate a raw stream entry. Raises BadEntry with a reason a user can act on."""
    job_id = fields.get("job", "")
    if not JOB_ID_RE.match(job_id or ""):
        job_id = ""
    body = fields.get("body")
    if body is None:
        raise BadEntry("malformed entry: no 'body' field", job_id)
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, TypeError) as e:
        raise BadEntry(f"malformed entry: body is not JSON ({e.msg if hasattr(e, 'msg') else e})",
                       job_id) from None
    if not isinstance(data, dict):
        raise BadEntry("malformed entry: body is not a JSON object", job_id)
    try:
        req = JobRequest.model_validate(data)
    except ValidationError as e:
        errs = "; ".join(f"{'.'.join(map(str, x['loc'])) or 'body'}: {x['msg']}"
                         for x in e.errors()[:5])
        raise BadEntry(f"invalid request: {errs}", job_id) from None
    if not job_id:
        raise BadEntry("malformed entry: missing or invalid 'job' id", "")
    if req.id is not None and req.id != job_id:
        raise BadEntry("malformed entry: body id differs from the entry's job id", job_id)
    return req


def sampling_params(req: JobRequest) -> SamplingParams:
    return SamplingParams(
        max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
        top_k=req.top_k, min_p=req.min_p, seed=req.seed,
        repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty, stop=list(req.stop),
        stop_token_ids=list(req.stop_token_ids), min_tokens=req.min_tokens,
        ignore_eos=req.ignore_eos, logprobs=req.logprobs)
