"""pagedq's client side. Never imports torch (a test asserts it).

    from pagedq.producer import Client
    with Client("redis://localhost:6379/0") as c:
        job = c.submit("Hello", max_tokens=32)
        for delta in c.stream_text(job):
            print(delta, end="", flush=True)

The wire protocol is in docs/protocol.md; its code (keys, schema, scripts, settings) is
pagedq.wire, whose public names are re-exported here.
"""
from pagedq.wire.errors import (
    EventsTrimmed,
    InvalidRequest,
    JobConflict,
    JobNotFound,
    NoWorker,
    Overloaded,
    PagedqError,
    ResultTimeout,
)
from pagedq.wire.keys import Keys
from pagedq.wire.schema import (
    ChatMessage,
    Choice,
    Event,
    FinalEvent,
    JobRecord,
    JobRequest,
    Status,
    TokenEvent,
    Usage,
)
from pagedq.wire.settings import Settings

from .aio import AsyncClient
from .client import Client

__all__ = [
    "AsyncClient", "ChatMessage", "Choice", "Client", "Event", "EventsTrimmed", "FinalEvent",
    "InvalidRequest", "JobConflict", "JobNotFound", "JobRecord", "JobRequest", "Keys",
    "NoWorker", "Overloaded", "PagedqError", "ResultTimeout", "Settings", "Status", "TokenEvent", "Usage",
]
