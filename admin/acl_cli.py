"""``pagedq acl``: print (or write) a Redis ACL file with one least-privilege user per role
and tenant (admin/acl.py has the rules; docs/security.md explains them).

Passwords never travel on the command line. Each user's comes from, in order:
  1. the environment: PAGEDQ_ACL_PASSWORD_<USER> (the user name in upper case, every
     character outside [A-Z0-9] as ``_``: PAGEDQ_ACL_PASSWORD_PRODUCER_TENANT1);
  2. ``--secrets-dir DIR``: the file DIR/<user>, if it exists;
  3. a new random one (32 bytes, URL-safe), written to DIR/<user> (mode 0600) with
     ``--secrets-dir``, else printed once on stderr. ``--no-generate`` refuses instead.
The file stores only each password's SHA-256 (``#<hex>``).

Exit codes: 0 written; 1 a file could not be read or written; 2 invalid input (a bad
prefix or role, a password missing or shorter than 16 characters), nothing written.
"""
from __future__ import annotations

import argparse
import os
import re
import secrets
import sys
from collections.abc import Iterable
from pathlib import Path

from pagedq.exits import EXIT_ERROR, EXIT_OK, guarded
from pagedq.wire.settings import Settings

from . import acl

ENV_PREFIX = "PAGEDQ_ACL_PASSWORD_"
MIN_PASSWORD_CHARS = 16  # the file's unsalted SHA-256 must not be easy to reverse


def env_name(user: str) -> str:
    return ENV_PREFIX + re.sub(r"[^A-Z0-9]", "_", user.upper())


def _csv(values: Iterable[str] | None) -> list[str]:
    """Repeated options, each possibly a comma-separated list, in order."""
    return [x.strip() for v in values or [] for x in v.split(",") if x.strip()]


def _read_secret(path: Path) -> str:
    return path.read_text(encoding="utf-8").rstrip("\r\n")


def _write_secret(path: Path, password: str) -> None:
    """A new file only (O_EXCL), readable by its owner alone."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(password)


def passwords_for(users: list[acl.User], secrets_dir: Path | None, generate: bool,
                  environ: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """(user -> password, names of the users whose password was generated and not stored).
    ValueError for a missing (with ``generate`` off) or too short password."""
    names = [env_name(u.name) for u in users]
    if len(set(names)) != len(names):
        raise ValueError("two users share one PAGEDQ_ACL_PASSWORD_* name: give the tenants "
                         "prefixes that differ in more than case or punctuation")
    out: dict[str, str] = {}
    shown: list[str] = []
    for u, var in zip(users, names, strict=True):
        path = secrets_dir / u.name if secrets_dir else None
        if environ.get(var):
            pw, where = environ[var], var
        elif path is not None and path.exists():
            pw, where = _read_secret(path), str(path)
        elif not generate:
            raise ValueError(f"no password for user {u.name}: set {var}"
                             + (f" or write {path}" if path else " or use --secrets-dir")
                             + " (or leave out --no-generate)")
        else:
            pw, where = secrets.token_urlsafe(32), ""
            if path is not None:
                _write_secret(path, pw)
            else:
                shown.append(u.name)
        if len(pw) < MIN_PASSWORD_CHARS:
            raise ValueError(f"the password of {u.name} from {where} is shorter than "
                             f"{MIN_PASSWORD_CHARS} characters")
        out[u.name] = pw
    return out, shown


def _write_file(path: Path, text: str) -> None:
    """Replaced whole (a reader never sees half a file). 0644: it holds hashes only, and
    redis-server may run as another user."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as e:  # name the file asked for, not the temporary one
        tmp.unlink(missing_ok=True)
        raise OSError(e.errno, e.strerror, str(path)) from None


def cmd_acl(args: argparse.Namespace) -> int:
    tenants = _csv(args.tenant) or [getattr(args, "prefix", None) or Settings().prefix]
    user_list = acl.users(tenants, _csv(args.worker_prefixes) or None,
                          tuple(_csv([args.roles])), _csv(args.gateway_prefixes) or None,
                          args.gateway_admin_prefix or getattr(args, "prefix", None)
                          or Settings().prefix,
                          args.partitions if args.partitions else Settings().partitions)
    secrets_dir = Path(args.secrets_dir).expanduser() if args.secrets_dir else None
    if secrets_dir is not None:
        secrets_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    passwords, shown = passwords_for(user_list, secrets_dir, not args.no_generate,
                                     dict(os.environ))
    text = acl.acl_file(passwords, user_list, args.default_user)
    if args.output:
        _write_file(Path(args.output).expanduser(), text)
    else:
        sys.stdout.write(text)
        sys.stdout.flush()
    if shown:
        print("pagedq: new passwords (shown once; the file keeps only their SHA-256):",
              file=sys.stderr)
        for name in shown:
            print(f"{name} {passwords[name]}", file=sys.stderr)
    return EXIT_OK


def _os_error(e: Exception) -> tuple[int, str] | None:
    if isinstance(e, OSError):
        return EXIT_ERROR, f"{e.strerror or e}: {e.filename}" if e.filename else str(e)
    return None


def register(subparsers: argparse._SubParsersAction,
             parents: Iterable[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "acl", parents=list(parents), formatter_class=argparse.RawDescriptionHelpFormatter,
        help="print a Redis 7 ACL file: least-privilege users per role and tenant",
        description="Print a Redis >= 7.0 ACL file (load it with redis-server --aclfile "
                    "FILE): users producer-<tenant>, reader-<tenant>, batch-<tenant>, "
                    "worker, gateway and admin, each allowed only what its role needs "
                    "(docs/security.md).",
        epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--tenant", action="append", metavar="PREFIX",
                   help="a tenant's key prefix; repeat or comma-separate for more "
                        "(default: --prefix, $PAGEDQ_PREFIX or pagedq)")
    p.add_argument("--worker-prefixes", action="append", metavar="A,B",
                   help="the prefixes the worker user may serve (default: every --tenant)")
    p.add_argument("--gateway-prefixes", action="append", metavar="A,B",
                   help="the tenants the gateway user may serve, those its API keys map to "
                        "(default: every --tenant)")
    p.add_argument("--gateway-admin-prefix", metavar="PREFIX",
                   help="the gateway's own --prefix, where its API keys and rate-limit "
                        "windows live (default: --prefix, $PAGEDQ_PREFIX or pagedq)")
    p.add_argument("--partitions", type=int, metavar="N",
                   help="the deployment's partitions: above 1 the patterns cover every "
                        "partition {P:p<k>} of each tenant (default: $PAGEDQ_PARTITIONS or 1)")
    p.add_argument("--roles", default=",".join(acl.ROLES), metavar="R,...",
                   help="the roles to write users for (default: %(default)s)")
    p.add_argument("--secrets-dir", metavar="DIR",
                   help="read each user's password from DIR/<user>, or write a new one "
                        "there, mode 0600 (default: none; new passwords go to stderr)")
    p.add_argument("--no-generate", action="store_true",
                   help="fail instead of making a password that is in neither the "
                        "environment nor --secrets-dir (default: off, generate)")
    p.add_argument("--default-user", choices=sorted(acl.DEFAULT_USER), default="off",
                   help="the unauthenticated user: off = nothing without AUTH; ping = PING "
                        "only, for health checks (default: %(default)s)")
    p.add_argument("-o", "--output", metavar="FILE",
                   help="write the ACL file here (default: stdout)")
    p.set_defaults(func=guarded(cmd_acl, _os_error))
