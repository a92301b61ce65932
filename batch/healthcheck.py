"""``python -m pagedq.batch.healthcheck``: the container health probe of
``pagedq batch worker``.

Healthy = Redis answers and an rq worker registered from this host (its container: the
hostname is the container id) listens on the control-plane queue ($PAGEDQ_BATCH_QUEUE).
rq keeps a worker's registration alive by its heartbeat and lets it expire when the
heartbeat stops, so a hung or dead worker turns unhealthy within rq's worker TTL; a clean
stop unregisters at once. Connects as the batch worker does: the same PAGEDQ_* settings
(URL, credentials, TLS) through wire/connection.py.

Exit codes (Docker's HEALTHCHECK convention): 0 healthy, 1 unhealthy (one line says why),
2 a usage error of this command.
"""
from __future__ import annotations

import argparse
import socket
import sys

from pagedq.wire.connection import connect
from pagedq.wire.redis_errors import redact_url
from pagedq.wire.settings import Settings

from .settings import BatchSettings

EXIT_HEALTHY, EXIT_UNHEALTHY = 0, 1


def check(settings: Settings, bs: BatchSettings, hostname: str) -> tuple[int, str]:
    from rq import Queue, Worker
    from rq.serializers import JSONSerializer

    conn, url = None, bs.batch_rq_url or settings.redis_url
    try:
        url = bs.rq_url(settings.redis_url, settings.redis_cluster)
        conn = connect(settings, url, cluster=False, socket_timeout=5, socket_connect_timeout=5)
        queue = Queue(bs.batch_queue, connection=conn, serializer=JSONSerializer)
        mine = [w.name for w in Worker.all(connection=conn, queue=queue)
                if w.hostname == hostname]
    except Exception as e:  # noqa: BLE001 - any failure to look is "unhealthy", with its reason
        return EXIT_UNHEALTHY, (f"cannot read rq workers at {redact_url(url)}: "
                                f"{type(e).__name__}: {e}")
    finally:
        if conn is not None:
            conn.close()
    if not mine:
        return EXIT_UNHEALTHY, (f"no rq worker of host {hostname!r} listens on queue "
                                f"{bs.batch_queue!r}")
    return EXIT_HEALTHY, f"ok: {', '.join(sorted(mine))} on queue {bs.batch_queue!r}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pagedq.batch.healthcheck",
        description="Probe this host's `pagedq batch worker` (exit 0 healthy, 1 unhealthy). "
                    "Redis URL, credentials and queue from the PAGEDQ_* environment.")
    p.add_argument("--hostname", default=socket.gethostname(),
                   help="the host whose rq worker counts (default: this one, %(default)s)")
    args = p.parse_args(argv)
    try:
        settings, bs = Settings(), BatchSettings()
    except ValueError as e:  # pydantic's ValidationError: a bad PAGEDQ_* value
        print(f"pagedq healthcheck: bad setting: {' '.join(str(e).split())}")
        return EXIT_UNHEALTHY
    code, line = check(settings, bs, args.hostname)
    print(line)
    return code


if __name__ == "__main__":
    sys.exit(main())
