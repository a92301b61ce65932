"""pagedq: queue-fed LLM generation (Redis streams in, continuous batching over a paged KV
cache, tokens streamed back through Redis). The documented entry point:

    import pagedq

    with pagedq.Client("redis://127.0.0.1:6379/0") as c:
        job = c.submit(messages=[{"role": "user", "content": "Hi!"}], max_tokens=32)
        print(c.result(job, timeout=60).text)

The client side (``Client``, ``AsyncClient``, ``Batches``, the request and record models,
the errors) imports no torch. ``LLMEngine`` and ``SamplingParams`` (the engine, for
offline use) load on first access, so ``import pagedq`` stays light. The implementation
lives in the packages ``producer`` (client), ``engine`` and ``worker``; these names are
the stable ones.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from producer import (
    AsyncBatches,
    AsyncClient,
    Batches,
    ChatMessage,
    Choice,
    Client,
    Event,
    EventsTrimmed,
    FinalEvent,
    InvalidRequest,
    JobConflict,
    JobNotFound,
    JobRecord,
    JobRequest,
    Keys,
    NoWorker,
    Overloaded,
    PagedqError,
    ResultTimeout,
    Settings,
    Status,
    TokenEvent,
    Usage,
)
from producer.cli import version as _version

if TYPE_CHECKING:  # for editors and type checkers; at run time they load lazily
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

__version__ = _version()

__all__ = [
    "AsyncBatches", "AsyncClient", "Batches", "ChatMessage", "Choice", "Client", "Event",
    "EventsTrimmed", "FinalEvent", "InvalidRequest", "JobConflict", "JobNotFound", "JobRecord",
    "JobRequest", "Keys", "LLMEngine", "NoWorker", "Overloaded", "PagedqError",
    "ResultTimeout", "SamplingParams", "Settings", "Status", "TokenEvent", "Usage",
    "__version__",
]


def __getattr__(name: str) -> Any:
    """``pagedq.LLMEngine`` / ``pagedq.SamplingParams``: the engine, imported on first use
    (it imports torch)."""
    if name == "LLMEngine":
        from engine.llm_engine import LLMEngine

        return LLMEngine
    if name == "SamplingParams":
        from engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'pagedq' has no attribute {name!r}")
