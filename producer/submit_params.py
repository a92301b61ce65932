"""The keyword parameters of ``Client.submit`` / ``AsyncClient.submit``: one per JobRequest
field (wire/schema.py) but ``v`` (the schema version), ``id`` (``job_id``), ``prompt``,
``messages`` and ``model`` (named on their own). tests/test_pagedq_package.py fails when
JobRequest gains a field that submit() lacks, or the two clients' signatures differ.
"""
from __future__ import annotations

from typing import Any

SUBMIT_FIELDS = frozenset({
    "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
    "presence_penalty", "frequency_penalty", "stop", "stop_token_ids", "seed", "ignore_eos",
    "min_tokens", "logprobs", "n", "priority", "lane", "timeout_s", "metadata",
})


def explicit(args: dict[str, Any]) -> dict[str, Any]:
    """The request fields among a submit() call's arguments (``locals()``); None = unset,
    so the schema's default applies."""
    return {k: v for k, v in args.items() if k in SUBMIT_FIELDS}
