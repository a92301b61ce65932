"""One AsyncClient (and, when batches are used, one AsyncBatches) per tenant prefix, made
on first use and kept: connection pools, not job state. Each request uses its tenant's."""
from __future__ import annotations

from pagedq.batch import AsyncBatches, BatchSettings
from pagedq.producer.aio import AsyncClient
from pagedq.wire.keys import check_name
from pagedq.wire.settings import Settings


class Tenants:
    def __init__(self, settings: Settings, batch_settings: BatchSettings) -> None:
        self.settings, self.batch_settings = settings, batch_settings
        self._clients: dict[str, AsyncClient] = {}
        self._batches: dict[str, AsyncBatches] = {}

    def client(self, prefix: str) -> AsyncClient:
        c = self._clients.get(prefix)
        if c is None:
            check_name("prefix", prefix)
            c = self._clients[prefix] = AsyncClient(
                settings=self.settings.model_copy(update={"prefix": prefix}))
        return c

    def batches(self, prefix: str) -> AsyncBatches:
        b = self._batches.get(prefix)
        if b is None:
            check_name("prefix", prefix)
            s = self.settings.model_copy(update={"prefix": prefix})
            b = self._batches[prefix] = AsyncBatches(
                s.redis_url, prefix=prefix, model=s.model, settings=s,
                batch_settings=self.batch_settings)
        return b

    async def aclose(self) -> None:
        for c in self._clients.values():
            await c.aclose()
        for b in self._batches.values():
            await b.close()
        self._clients.clear()
        self._batches.clear()
