"""pagedq: queue-fed LLM generation (Redis streams in, continuous batching over a paged KV
cache, tokens streamed back through Redis). The documented entry point:

    import pagedq

    with pagedq.Client("redis://127.0.0.1:6379/0") as c:
        job = c.submit(messages=[{"role": "user", "content": "Hi!"}], max_tokens=32)
        print(c.result(job, timeout=60).text)

The client side (``Client``, ``AsyncClient``, ``Batches``, the request and record models,
the errors) imports no torch. ``LLM`` (vLLM's offline API: ``from pagedq import LLM,
SamplingParams``), ``LLMEngine`` and ``SamplingParams`` (the engine, for offline use) load
on first access, so ``import pagedq`` stays light. The implementation
lives in the subpackages ``pagedq.wire`` (the wire contract: keys, schema, scripts,
settings), ``pagedq.producer`` (the clients), ``pagedq.batch`` (bulk batches),
``pagedq.admin`` (ACL file, inspection, dead letters), ``pagedq.engine``, ``pagedq.worker``,
``pagedq.kernels`` and ``pagedq.gateway``; these names are the stable ones. This folder
also holds the `pagedq` command's root (``pagedq.cli``).
"""
from __future__ import annotations

import os as _os
from typing import TYPE_CHECKING, Any

# The subpackages are the repository's top-level folders (wire/, producer/, worker/, ...), installed
# inside this package by pyproject's package-dir. A checkout run without installing it
# (PYTHONPATH=<checkout>, as on a GPU machine without pip) has them beside this folder, not
# in it: then look there too. An installed pagedq holds them itself and skips this.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if (not _os.path.isdir(_os.path.join(_os.path.dirname(__file__), "engine"))
        and _os.path.isfile(_os.path.join(_checkout, "engine", "__init__.py"))
        and _os.path.isfile(_os.path.join(_checkout, "pyproject.toml"))):
    __path__.append(_checkout)

# Every public name loads on first access: `import pagedq.engine` (a GPU machine without
# redis) must not import the client, nor `import pagedq` the engine (torch).
if TYPE_CHECKING:  # for editors and type checkers; at run time they load lazily
    from pagedq.batch import AsyncBatches, Batches
    from pagedq.engine.errors import EngineClosed
    from pagedq.engine.llm import LLM
    from pagedq.engine.llm_engine import LLMEngine
    from pagedq.engine.sampling_params import SamplingParams
    from pagedq.producer import (
        AsyncClient,
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

__all__ = [
    "AsyncBatches", "AsyncClient", "Batches", "ChatMessage", "Choice", "Client",
    "EngineClosed", "Event", "EventsTrimmed", "FinalEvent", "InvalidRequest", "JobConflict", "JobNotFound", "JobRecord",
    "JobRequest", "Keys", "LLM", "LLMEngine", "NoWorker", "Overloaded", "PagedqError",
    "ResultTimeout", "SamplingParams", "Settings", "Status", "TokenEvent", "Usage",
    "__version__",
]
# where each name lives: the engine's (LLM and LLMEngine import torch), the batches', else the
# client side (pagedq.producer re-exports the wire contract's names it uses)
_HOME = {**{name: "pagedq.producer" for name in __all__ if name != "__version__"},
         "AsyncBatches": "pagedq.batch", "Batches": "pagedq.batch",
         "EngineClosed": "pagedq.engine.errors",
         "LLM": "pagedq.engine.llm",
         "LLMEngine": "pagedq.engine.llm_engine",
         "SamplingParams": "pagedq.engine.sampling_params"}


def __getattr__(name: str) -> Any:
    """The public names, imported on first use (``LLMEngine`` imports torch)."""
    import importlib

    if name == "__version__":
        from pagedq.cli import version

        value: Any = version()
    elif name in _HOME:
        value = getattr(importlib.import_module(_HOME[name]), name)
    else:
        raise AttributeError(f"module 'pagedq' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
