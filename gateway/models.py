"""Which models a tenant's workers serve, as ``/v1/models`` and the 404/503 of a request
say it: a model is listed while a worker serves it or served it within ``SERVED_WINDOW_S``
(wire/keys.py: a worker stopped cleanly, crashed, or restarting). Its ``created`` is the
time of the answer, as vLLM's: pagedq keeps no model's creation time, and the gateway's
Redis user may not read the workers' own records (docs/security.md).

A request for a model listed but served by no live worker is a 503 ``no_worker`` with
Retry-After (the SDKs retry it: a rolling restart goes unnoticed); one for any other model
is a 404 ``model_not_found``. Everything is read from partition 0's serving sets (the
workers write every partition's) on Redis, with this process's clock, as the workers
score them with theirs.
"""
from __future__ import annotations

import time
from typing import Any

from pagedq.producer.aio import AsyncClient
from pagedq.wire.keys import SERVED_WINDOW_S

from .errors import APIError

RETRY_AFTER_S = 5


async def served(client: AsyncClient, only: str | None = None) -> dict[str, dict[str, Any]]:
    """Model -> {"live": workers alive now, "created": Unix seconds} of the models served
    now or within the window (``only``: that one model, if it is)."""
    home = client.keys.home
    models = [only] if only is not None else sorted(await client.redis.smembers(home.models))
    now = time.time()
    async with client.redis.pipeline(transaction=False) as pipe:
        for m in models:
            pipe.zrangebyscore(home.serving(m), now - SERVED_WINDOW_S, "+inf", withscores=True)
        members = await pipe.execute()
    out: dict[str, dict[str, Any]] = {}
    for m, ms in zip(models, members, strict=True):
        if ms:
            out[m] = {"live": sum(expiry >= now for _, expiry in ms), "created": int(now)}
    return out


def model_object(name: str, info: dict[str, Any]) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": info["created"], "owned_by": "pagedq"}


async def unavailable(client: AsyncClient, model: str) -> APIError:
    """Why a request for ``model`` finds no live worker: 503 if it was served within the
    window, else 404."""
    if await served(client, model):
        return APIError(503, f"no live worker serves the model {model!r} now; retry later",
                        "no_worker", retry_after=RETRY_AFTER_S)
    return not_found(model)


def not_found(model: str) -> APIError:
    return APIError(404, f"the model {model!r} does not exist: no worker has served it in "
                    f"the last {int(SERVED_WINDOW_S)} s", "model_not_found", "model")
