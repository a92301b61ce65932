"""Which Redis errors no retry will fix, and how each is told (a part of how pagedq connects
to Redis, wire/connection.py; docs/deployment.md "TLS and secrets").

Invariants:
* a URL reaching a log line, an exception message or CLI output goes through
  ``redact_url`` first (user:***@, password=***);
* ``is_fatal(e)``: wrong credentials, a missing ACL permission or a TLS certificate
  problem. Retry loops re-raise these (as ``RedisUnusable``, which is not a
  redis.ConnectionError, so no retry loop catches it again); Redis being down or
  restarting (refused, reset, timeout, LOADING; on a cluster a failover: ``RETRYABLE``)
  stays retryable;
* ``looks_cut_by_tls``: a TLS connection cut without a reason, which
  connection.py's ``diagnose_tls`` looks into once per call.

No torch, no worker imports.
"""
from __future__ import annotations

import re
import ssl
from urllib.parse import unquote, urlsplit

import redis
from redis.exceptions import (
    AuthenticationError,
    AuthenticationWrongNumberOfArgsError,
    AuthorizationError,
    NoPermissionError,
)

# replies (first word) that mean "these credentials may not do this"; redis-py maps most
# to the exception classes below, the prefixes catch the rest (e.g. inside a script)
FATAL_REPLIES = ("WRONGPASS", "NOPERM", "NOAUTH")
FATAL_CLASSES = (AuthenticationError, AuthorizationError, AuthenticationWrongNumberOfArgsError,
                 NoPermissionError)
# TLS failures that are transport noise (a peer gone mid-handshake), not configuration
SSL_TRANSIENT = (ssl.SSLEOFError, ssl.SSLZeroReturnError, ssl.SSLSyscallError,
                  ssl.SSLWantReadError, ssl.SSLWantWriteError)
_SSL_NOISE = re.compile(r"^\[[A-Z0-9_ ]+: [A-Z0-9_]+\] | \(_ssl\.c:\d+\)$")
_TLS_HINT = ("check PAGEDQ_REDIS_TLS_CA, PAGEDQ_REDIS_TLS_CERT, PAGEDQ_REDIS_TLS_KEY and the "
             "server's tls-* settings")
_TLS_HINTS = {
    "CERTIFICATE_VERIFY_FAILED": "the server's certificate is not signed by "
                                 "PAGEDQ_REDIS_TLS_CA (or a system CA), or does not name "
                                 "the URL's host",
    "TLSV13_ALERT_CERTIFICATE_REQUIRED": "the server wants a client certificate: set "
                                         "PAGEDQ_REDIS_TLS_CERT and PAGEDQ_REDIS_TLS_KEY",
    "WRONG_VERSION_NUMBER": "is that port speaking TLS? a plain Redis port needs redis://",
}
_QUERY_SECRET = re.compile(r"(?i)([?&](?:password|ssl_password)=)[^&#]*")


# What a Redis restart looks like to a client: refused or cut connections, timeouts, and
# LOADING replies while it loads its AOF (redis.BusyLoadingError is a ConnectionError);
# on a Redis Cluster also a master failing over: CLUSTERDOWN / MASTERDOWN and TRYAGAIN
# replies, or a slot no node serves yet (redis-py's cluster client retries these itself a
# few times first, reloading the slot map). Every retry loop of the clients and the
# worker takes these (wrong credentials and TLS errors excepted: ``is_fatal``).
RETRYABLE: tuple[type[Exception], ...] = (
    redis.ConnectionError, redis.TimeoutError, redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError, redis.exceptions.SlotNotCoveredError)


class RedisSetupError(ValueError):
    """A connection setting that cannot be used (an unreadable password or TLS file, the
    password given twice, TLS files with a redis:// URL): one line saying which and why.
    A ValueError: the client CLI reports it as invalid input (exit 2), the worker CLI as
    bad configuration (exit 78)."""


class RedisUnusable(redis.RedisError):
    """Redis answered but refuses these credentials or this TLS set-up; waiting will not
    help. ``str()``: ``cannot use Redis at <redacted url>: <why>``; the redis-py error is
    ``__cause__``. Deliberately not a redis.ConnectionError: retry loops let it through."""

    def __init__(self, url: str, error: BaseException) -> None:
        self.url = redact_url(url)
        self.reason = describe(error, url)
        super().__init__(f"cannot use Redis at {self.url}: {self.reason}")


# ---------------------------------------------------------------- redaction

def redact_url(url: str) -> str:
    """``url`` fit for a log line: the password of ``user:password@`` and of ``password=``
    query arguments replaced by ``***``. Errs on the side of hiding: everything up to the
    last ``@`` after the scheme is taken as user information (a password may hold ``/``
    or ``@`` unencoded, and redis-py reads it the same way)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    at = rest.rfind("@")
    if at >= 0:
        user, colon, _password = rest[:at].partition(":")
        rest = f"{user}:***@" + rest[at + 1:] if colon else rest
    return (scheme + sep if sep else "") + _QUERY_SECRET.sub(r"\1***", rest)


def _url_password(url: str) -> str | None:
    try:
        p = urlsplit(url).password
    except ValueError:
        return None
    return unquote(p) if p else None


def describe(error: BaseException, url: str = "") -> str:
    """Why ``error`` makes Redis unusable, in one line, with the settings to look at; the
    URL's password, should a message echo it, is masked."""
    if isinstance(error, RedisUnusable):
        return error.reason
    ssl_error = _ssl_cause(error)
    if ssl_error is not None:
        reason = ssl_error.reason or type(ssl_error).__name__
        what = getattr(ssl_error, "verify_message", "") or _SSL_NOISE.sub("", str(ssl_error))
        text = f"TLS: {what} [{reason}] ({_TLS_HINTS.get(reason, _TLS_HINT)})"
    elif isinstance(error, NoPermissionError) or str(error).startswith("NOPERM"):
        text = f"permission denied: {error} (the Redis user's ACL)"
    else:
        text = (f"authentication failed: {error} (check PAGEDQ_REDIS_USERNAME, "
                "PAGEDQ_REDIS_PASSWORD or PAGEDQ_REDIS_PASSWORD_FILE, or the URL's user)")
    secret = _url_password(url) if url else None
    if secret:
        text = text.replace(secret, "***")
    return " ".join(text.split())


# ---------------------------------------------------------------- fatal errors

def _ssl_cause(error: BaseException) -> ssl.SSLError | None:
    """The ssl.SSLError behind a redis-py ConnectionError (it wraps the OSError it got
    while connecting or reading), unless it is transport noise."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, ssl.SSLError):
            return None if isinstance(e, SSL_TRANSIENT) else e
        e = e.__cause__ or e.__context__
    return None


def is_fatal(error: BaseException) -> bool:
    """Wrong or missing credentials, a missing ACL permission, or a TLS certificate /
    handshake error: retrying cannot fix it."""
    if isinstance(error, (RedisUnusable, *FATAL_CLASSES)):
        return True
    if isinstance(error, redis.ResponseError):
        return str(error).split(" ", 1)[0] in FATAL_REPLIES
    if isinstance(error, redis.ConnectionError):
        return _ssl_cause(error) is not None
    return False


def looks_cut_by_tls(url: str, error: BaseException) -> bool:
    """A TLS connection that ended without saying why (EOF, reset, closed): with TLS 1.3
    the server judges the client's certificate after the handshake, so its refusal can
    race the client's first write and reach redis-py as a bare EOF."""
    if not url.lower().startswith("rediss://") or not isinstance(error, redis.ConnectionError):
        return False
    if "closed by server" in str(error):
        return True
    e: BaseException | None = error
    for _ in range(8):  # the cause chain, short
        if e is None:
            return False
        if isinstance(e, ssl.SSLEOFError | ConnectionResetError | BrokenPipeError):
            return True
        e = e.__cause__ or e.__context__
    return False
