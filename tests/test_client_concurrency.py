"""Many concurrent streams from one client: more blocking reads than redis-py's default
pool (100 connections) must wait for a connection, not fail."""
from __future__ import annotations

import asyncio
import threading
import time

from pagedq.producer import AsyncClient
from pagedq.wire.keys import out_entry_id
from pagedq.wire.schema import final_fields, token_fields


def test_async_client_streams_150_jobs_at_once(redis_server, r):
    n = 150

    async def main() -> list[list]:
        async with AsyncClient(redis_server.url, prefix="many") as c:
            ids = await c.submit_many([{"prompt": f"p{i}", "max_tokens": 2} for i in range(n)])

            def worker_side() -> None:  # write each job's events once every stream blocks
                time.sleep(1.0)
                for j in ids:
                    r.hset(c.keys.job(j), mapping={"status": "finished", "text": "x"})
                    r.xadd(c.keys.out(j), token_fields(0, "x", [7]), id=out_entry_id(0))
                    r.xadd(c.keys.out(j), final_fields(1, "finished", "length", "x", "", 1, 1),
                           id=out_entry_id(1))

            writer = threading.Thread(target=worker_side, daemon=True)
            writer.start()

            async def collect(j: str) -> list:
                return [e async for e in c.stream(j, timeout=30)]

            try:
                return await asyncio.gather(*[collect(j) for j in ids])
            finally:  # its last reply may still be unread: never leave it to the teardown
                await asyncio.to_thread(writer.join, 30)

    results = asyncio.run(main())
    assert len(results) == n
    assert all([e.index for e in evs] == [0, 1] and evs[-1].text == "x" for evs in results)
