"""``python -m pagedq.worker.healthcheck``: the container health probe of a pagedq worker.

GETs the worker's /healthz (``--ready``: /readyz) on 127.0.0.1 at $PAGEDQ_METRICS_PORT
(the port the worker itself reads) and prints the JSON answer, which Docker keeps in
``docker inspect``'s health log. The python:3.11-slim image has no curl; this needs only
the standard library and starts in a few tens of milliseconds (no pagedq import).

Exit codes (Docker's HEALTHCHECK convention): 0 healthy; 1 unhealthy: a 503 (wedged,
starting, stopped; draining with --ready), no answer (the worker is still loading its
model, or gone), or no metrics port configured; 2 a usage error of this command.
"""
from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request

EXIT_HEALTHY, EXIT_UNHEALTHY = 0, 1


def default_url(ready: bool) -> str | None:
    port = os.environ.get("PAGEDQ_METRICS_PORT", "").strip()
    if not port.isdigit() or int(port) == 0:
        return None
    return f"http://127.0.0.1:{int(port)}/{'readyz' if ready else 'healthz'}"


def probe(url: str, timeout: float) -> tuple[int, str]:
    """(exit code, one line to print)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return EXIT_HEALTHY, resp.read().decode(errors="replace").strip()
    except urllib.error.HTTPError as e:  # 503 and its JSON reason
        return EXIT_UNHEALTHY, e.read().decode(errors="replace").strip() or f"HTTP {e.code}"
    except (urllib.error.URLError, OSError) as e:
        why = getattr(e, "reason", e)
        return EXIT_UNHEALTHY, (f"no answer from {url}: {why} (the worker is loading its model, "
                                f"or gone)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pagedq.worker.healthcheck",
        description="Probe a pagedq worker's /healthz (exit 0 healthy, 1 unhealthy).")
    p.add_argument("--ready", action="store_true",
                   help="probe /readyz instead (unhealthy while draining) (default: /healthz)")
    p.add_argument("--url", default=None,
                   help="the URL to probe (default: http://127.0.0.1:$PAGEDQ_METRICS_PORT"
                        "/healthz)")
    p.add_argument("--timeout", type=float, default=5.0, metavar="S",
                   help="seconds to wait for the answer (default: %(default)s)")
    args = p.parse_args(argv)
    url = args.url or default_url(args.ready)
    if url is None:
        print("pagedq healthcheck: no metrics port: set PAGEDQ_METRICS_PORT (the worker serves "
              "/healthz on it)")
        return EXIT_UNHEALTHY
    code, line = probe(url, args.timeout)
    print(line)
    return code


if __name__ == "__main__":
    sys.exit(main())
