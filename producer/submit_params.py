"""The keyword parameters of ``Client.submit`` / ``AsyncClient.submit``: one per JobRequest
field (wire/schema.py, its sampling fields declared in wire/sampling.py) but ``v`` (the
schema version), ``id`` (``job_id``), ``prompt``, ``messages`` and ``model`` (named on their
own). tests/test_pagedq_package.py fails when JobRequest gains a field that submit() lacks,
or the two clients' signatures differ.
"""
from __future__ import annotations

from typing import Any

from pagedq.wire.schema import JobRequest

NAMED_ON_THEIR_OWN = frozenset({"v", "id", "prompt", "messages", "model"})
SUBMIT_FIELDS = frozenset(JobRequest.model_fields) - NAMED_ON_THEIR_OWN


def explicit(args: dict[str, Any]) -> dict[str, Any]:
    """The request fields among a submit() call's arguments (``locals()``); None = unset,
    so the schema's default applies."""
    return {k: v for k, v in args.items() if k in SUBMIT_FIELDS}
