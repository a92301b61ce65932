"""``pagedq gateway``: serve the OpenAI-compatible HTTP API; ``pagedq gateway key add |
list | revoke``: manage its API keys.

``register(subparsers, parents)`` adds the command to the root parser (pagedq/cli.py). This
module imports no web framework: FastAPI and uvicorn are imported when the server starts,
so ``pagedq -h`` stays fast.

Exit codes of ``pagedq gateway``:

   0  clean stop (SIGTERM/SIGINT: open requests finish first)
   1  Redis does not answer at start
   2  command-line usage error
  78  bad configuration: one line "pagedq: ..." on stderr (a setting, the keys file, an
      address or port that cannot be bound, Redis refusing the credentials or TLS set-up,
      FastAPI/uvicorn not installed)

Exit codes of ``pagedq gateway key ...``: 0 done, 1 Redis or another error, 2 invalid input,
3 no key matched (revoke).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
from collections.abc import Iterable

from pagedq.exits import EXIT_ERROR, EXIT_NOT_FOUND, EXIT_OK, guarded

from .settings import GatewaySettings

EXIT_CONFIG = 78  # the worker's (worker/fatal.py): bad configuration
EXIT_CODES_HELP = "exit codes:\n" + __doc__.split("Exit codes of ``pagedq gateway``:\n\n", 1)[1]
_G = GatewaySettings.model_fields


class ConfigError(Exception):
    """A setting that parsed but cannot be used: one line, exit 78."""


def register(subparsers: argparse._SubParsersAction,
             parents: Iterable[argparse.ArgumentParser]) -> None:
    parents = list(parents)
    fmt = argparse.RawDescriptionHelpFormatter
    g = subparsers.add_parser(
        "gateway", help="serve OpenAI's HTTP API (chat/completions, completions, models, "
                        "files, batches) over pagedq",
        description="Serve OpenAI's HTTP API over pagedq (docs/gateway.md). Also: "
                    "pagedq gateway key add|list|revoke.",
        parents=parents, epilog=EXIT_CODES_HELP, formatter_class=fmt)
    g.add_argument("--host", default=None,
                   help=f"address to listen on; 0.0.0.0 = every interface "
                        f"(default: $PAGEDQ_GATEWAY_HOST or {_G['host'].default})")
    g.add_argument("--port", type=int, default=None,
                   help=f"TCP port (default: $PAGEDQ_GATEWAY_PORT or {_G['port'].default})")
    g.add_argument("--workers", type=int, default=None, metavar="N",
                   help="uvicorn worker processes (default: $PAGEDQ_GATEWAY_WORKERS or "
                        f"{_G['workers'].default})")
    g.add_argument("--auth", choices=("auto", "on", "off"), default=None,
                   help="API keys: auto = required once the key store holds a key, on = "
                        "always, off = never (no rate limits) (default: $PAGEDQ_GATEWAY_AUTH "
                        f"or {_G['auth'].default})")
    g.add_argument("--no-auth", dest="auth", action="store_const", const="off",
                   help="the same as --auth off (default: not set)")
    _keys_file_arg(g)
    g.add_argument("--model", default=None,
                   help="the model of a request that names none (default: $PAGEDQ_MODEL or "
                        "smollm2)")
    g.add_argument("--batch-dir", default=None, metavar="DIR",
                   help="the batch folder, shared with the rq workers; uploads go under "
                        "DIR/uploads (default: $PAGEDQ_BATCH_DIR or "
                        "~/.local/share/pagedq/batches)")
    g.add_argument("--log-level", default=None,
                   choices=("debug", "info", "warning", "error", "critical"), type=str.lower,
                   help="log level of the gateway's and uvicorn's lines on stderr "
                        f"(default: $PAGEDQ_GATEWAY_LOG_LEVEL or {_G['log_level'].default})")
    g.set_defaults(func=cmd_gateway)

    sub = g.add_subparsers(dest="gateway_command", metavar="COMMAND")
    k = sub.add_parser("key", help="manage API keys", description="Manage API keys.",
                       parents=parents, epilog=EXIT_CODES_HELP, formatter_class=fmt)
    ksub = k.add_subparsers(dest="key_command", required=True, metavar="ACTION")
    a = ksub.add_parser("add", help="make a key; prints it once (it is stored hashed)",
                        description="Make a key, print it once on stdout (only its SHA-256 "
                                    "is stored) and its id on stderr.",
                        parents=parents, formatter_class=fmt)
    a.add_argument("--tenant", default=None,
                   help="the pagedq key prefix this key's requests use "
                        "(default: --prefix, i.e. $PAGEDQ_PREFIX or pagedq)")
    a.add_argument("--rpm", type=int, default=0, help="requests per minute, 0 = unlimited "
                                                      "(default: %(default)s)")
    a.add_argument("--tpm", type=int, default=0,
                   help="tokens per minute (prompt + completion), 0 = unlimited "
                        "(default: %(default)s)")
    a.add_argument("--name", default="", help="a label for list/revoke (default: none)")
    _keys_file_arg(a)
    a.set_defaults(func=guarded(cmd_key_add))
    ls = ksub.add_parser("list", help="list keys (id, name, tenant, limits) as JSON lines",
                         description="List keys as JSON lines (never the keys themselves).",
                         parents=parents, formatter_class=fmt)
    _keys_file_arg(ls)
    ls.set_defaults(func=guarded(cmd_key_list))
    rv = ksub.add_parser("revoke", help="remove a key by id (>= 8 hex digits) or name",
                         description="Remove the keys whose id starts with ID (at least 8 "
                                     "hex digits) or whose name is ID.",
                         parents=parents, formatter_class=fmt)
    rv.add_argument("id", metavar="ID")
    _keys_file_arg(rv)
    rv.set_defaults(func=guarded(cmd_key_revoke))


def _keys_file_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--keys-file", default=None, metavar="FILE",
                   help="the key store is this JSON-lines file instead of Redis "
                        "(default: $PAGEDQ_GATEWAY_KEYS_FILE or none: Redis)")


# ---- the server

def _settings(args: argparse.Namespace) -> tuple:
    from pydantic import ValidationError

    from pagedq.batch import BatchSettings
    from pagedq.wire.settings import Settings

    def pick(**kw: object) -> dict:
        return {k: v for k, v in kw.items() if v is not None}
    try:
        s = Settings(**pick(redis_url=getattr(args, "redis_url", None),
                            prefix=getattr(args, "prefix", None), model=args.model))
        g = GatewaySettings(**pick(host=args.host, port=args.port, workers=args.workers,
                                   auth=args.auth, keys_file=args.keys_file,
                                   log_level=args.log_level))
        b = BatchSettings(**pick(batch_dir=args.batch_dir))
    except ValidationError as e:
        err = e.errors()[0]
        name = str(err["loc"][0]) if err.get("loc") else "?"
        raise ConfigError(f"--{name.replace('_', '-')}: {err['msg']} "
                          f"(got {err.get('input')!r})") from None
    from pagedq.wire.keys import check_name
    try:
        check_name("prefix", s.prefix)
        check_name("model", s.model)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return s, g, b


def _check(s, g) -> None:
    """What can fail before serving, each as one line (ConfigError, or exit 1 for Redis)."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"the gateway needs FastAPI and uvicorn ({e}): "
                          "pip install 'pagedq[gateway]'") from None
    if g.keys_file:
        from .apikeys import load_file
        try:
            load_file(g.keys_file)
        except (OSError, ValueError) as e:
            raise ConfigError(f"--keys-file: {' '.join(str(e).split())}") from None
    try:
        with socket.create_server((g.host, g.port), reuse_port=False):
            pass
    except (OSError, OverflowError) as e:
        raise ConfigError(f"--host {g.host} --port {g.port} cannot be bound: {e}") from None


def _redis_problem(s) -> tuple[int, str] | None:
    """(exit code, line) when Redis cannot be used: its settings or credentials are wrong
    (78), or it does not answer (1)."""
    import redis

    from pagedq.wire.connection import connect
    from pagedq.wire.redis_errors import describe, is_fatal, redact_url
    try:
        r = connect(s, socket_connect_timeout=5, socket_timeout=5)
    except ValueError as e:  # RedisSetupError: a password/TLS setting that cannot be used
        return EXIT_CONFIG, str(e)
    try:
        r.ping()
    except redis.RedisError as e:
        code = EXIT_CONFIG if is_fatal(e) else EXIT_ERROR
        return code, f"cannot use Redis at {redact_url(s.redis_url)}: {describe(e, s.redis_url)}"
    finally:
        r.close()
    return None


class _Stopped(Exception):
    pass


def _stop(signum: int, frame: object) -> None:
    raise _Stopped(signum)


def cmd_gateway(args: argparse.Namespace) -> int:
    try:
        s, g, b = _settings(args)
        _check(s, g)
    except ConfigError as e:
        print(f"pagedq: {' '.join(str(e).split())}", file=sys.stderr)
        return EXIT_CONFIG
    problem = _redis_problem(s)
    if problem:
        print(f"pagedq: {' '.join(problem[1].split())}", file=sys.stderr)
        return problem[0]
    # every uvicorn worker process builds its app from the environment (create_app)
    os.environ.update({"PAGEDQ_REDIS_URL": s.redis_url, "PAGEDQ_PREFIX": s.prefix,
                       "PAGEDQ_MODEL": s.model, "PAGEDQ_GATEWAY_AUTH": g.auth,
                       "PAGEDQ_GATEWAY_KEYS_FILE": g.keys_file,
                       "PAGEDQ_GATEWAY_LOG_LEVEL": g.log_level,
                       "PAGEDQ_BATCH_DIR": b.batch_dir})
    import uvicorn

    # uvicorn re-raises the stop signal once it has shut down: ours turns it into exit 0
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        uvicorn.run("pagedq.gateway.app:create_app", factory=True, host=g.host, port=g.port,
                    workers=g.workers, log_level=g.log_level, timeout_graceful_shutdown=30)
    except _Stopped:
        pass
    return EXIT_OK


# ---- keys

def _store(args: argparse.Namespace) -> dict:
    """Where keys live: a file, or the Redis hash under the admin prefix."""
    keys_file = args.keys_file or os.environ.get("PAGEDQ_GATEWAY_KEYS_FILE") or None
    if keys_file:
        return {"keys_file": keys_file}
    from pagedq.wire.connection import connect
    from pagedq.wire.settings import Settings
    s = Settings(**{k: v for k in ("redis_url", "prefix")
                    if (v := getattr(args, k, None)) is not None})
    return {"r": connect(s, decode_responses=True), "admin_prefix": s.prefix}


def cmd_key_add(args: argparse.Namespace) -> int:
    from .apikeys import KeyRecord, add

    store = _store(args)
    tenant = args.tenant or getattr(args, "prefix", None) or store.get("admin_prefix") \
        or os.environ.get("PAGEDQ_PREFIX") or "pagedq"
    rec = KeyRecord(tenant=tenant, rpm=args.rpm, tpm=args.tpm, name=args.name)
    key, kid = add(rec, **store)
    print(key)
    print(f"pagedq: key {kid} for tenant {tenant!r} (rpm {args.rpm or 'unlimited'}, tpm "
          f"{args.tpm or 'unlimited'}); it is shown only now", file=sys.stderr)
    return EXIT_OK


def cmd_key_list(args: argparse.Namespace) -> int:
    from .apikeys import ID_LEN, records

    for sha, rec in sorted(records(**_store(args)).items(), key=lambda x: x[1].created):
        print(json.dumps({"id": sha[:ID_LEN], "name": rec.name, "tenant": rec.tenant,
                          "rpm": rec.rpm, "tpm": rec.tpm, "created": rec.created}))
    return EXIT_OK


def cmd_key_revoke(args: argparse.Namespace) -> int:
    from .apikeys import revoke

    gone = revoke(args.id, **_store(args))
    if not gone:
        print(f"pagedq: no key has the id or name {args.id!r}", file=sys.stderr)
        return EXIT_NOT_FOUND
    for kid in gone:
        print(kid)
    return EXIT_OK
