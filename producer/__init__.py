"""pagedq's client side. Never imports torch (a test asserts it).

    from pagedq.producer import Client
    with Client("redis://localhost:6379/0") as c:
        job = c.submit("Hello", max_tokens=32)
        for delta in c.stream_text(job):
            print(delta, end="", flush=True)

The wire protocol is in docs/protocol.md; keys and schema in producer/keys.py and
producer/schema.py.
"""
from .aio import AsyncClient
from .client import Client
from .errors import (
    EventsTrimmed,
    InvalidRequest,
    JobConflict,
    JobNotFound,
    NoWorker,
    Overloaded,
    PagedqError,
    ResultTimeout,
)
from .keys import Keys
from .schema import (
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
from .settings import Settings

__all__ = [
    "AsyncClient", "ChatMessage", "Choice", "Client", "Event", "EventsTrimmed", "FinalEvent",
    "InvalidRequest", "JobConflict", "JobNotFound", "JobRecord", "JobRequest", "Keys",
    "NoWorker", "Overloaded", "PagedqError", "ResultTimeout", "Settings", "Status", "TokenEvent", "Usage",
]
from .batch import AsyncBatches as AsyncBatches, Batches as Batches  # noqa: E402, I001
