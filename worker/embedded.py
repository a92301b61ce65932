"""Whether a Redis answers at a URL: `pagedq demo` checks the one the user named (it starts
an embedded redis-server when none is named, never falling back to whatever answers on
the default port)."""
from __future__ import annotations

from pagedq.wire.connection import probe
from pagedq.wire.settings import Settings


def redis_answers(url: str, settings: Settings | None = None) -> bool:
    """Whether a Redis answers at ``url`` (with the settings' credentials and TLS). One
    that answers but refuses them raises RedisUnusable: starting an embedded server in
    its place would hide the mistake."""
    return probe(settings or Settings(), url, timeout_s=1.0)
