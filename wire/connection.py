"""How every part of pagedq connects to Redis: credentials, TLS, URL redaction, and which
Redis errors no retry will fix (docs/deployment.md "TLS and secrets").

``redis_kwargs(settings, url)`` is the one place that turns Settings into the keyword
arguments of redis-py's ``from_url`` (username, password, ssl_*). Every connection
factory passes them: Client/AsyncClient pools (producer/reader.py ``client_setup``), the
worker (worker/service.py), the demo's probe (worker/embedded.py), the worker CLI's URL
check, the rq queue and the rq worker (batch/). A connection built without them
would miss the password or the TLS files.

Invariants:
* the password is never needed on a command line: PAGEDQ_REDIS_PASSWORD, or
  PAGEDQ_REDIS_PASSWORD_FILE (read here, each time a factory is built: at start), or the URL;
  giving it in two places is an error rather than a silent choice;
* which errors no retry will fix (``is_fatal``, ``RedisUnusable``, ``RETRYABLE``) and
  URL redaction (``redact_url``) are wire/redis_errors.py;
* a TLS connection cut without a reason (TLS 1.3 servers refuse a client certificate after
  the handshake, racing the client's first write) is looked into once per call by
  ``diagnose_tls`` (a handshake and a read of our own), so a missing client certificate
  is reported as such instead of being retried as an outage.

Redis Cluster (``settings.redis_cluster``, docs/deployment.md "Redis Cluster"): the same
factories return redis-py's cluster clients (``connect_cluster``, ``connect_async``,
``client_redis``), with the same credentials and TLS, starting from the URL's node; they
follow MOVED/ASK and, after a connection error or CLUSTERDOWN, reload the slot map and
retry a few times on their own before our retry loops (``RETRYABLE``) take over. rq never
gets one (``cluster=False``): it cannot use a cluster.

No torch, no worker imports: the producer side owns this; the worker imports it.
"""
from __future__ import annotations

import contextlib
import socket
import ssl
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote, urlsplit

import redis

from . import cluster_keys
from .redis_errors import (
    SSL_TRANSIENT,
    RedisSetupError,
    RedisUnusable,
    is_fatal,
    looks_cut_by_tls,
    redact_url,
)
from .settings import Settings

# ---------------------------------------------------------------- probing

def probe(settings: Settings, url: str | None = None, timeout_s: float = 5.0) -> bool:
    """One PING with the configured credentials and TLS: True if Redis answered, False
    if it does not answer (refused, timeout: callers keep their own behaviour for an
    outage). Raises RedisUnusable when Redis refuses the credentials or the TLS set-up
    (RedisSetupError for settings that cannot be used)."""
    url = url or settings.redis_url
    r = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s,
                             **redis_kwargs(settings, url))
    try:
        r.ping()
        return True
    except redis.RedisError as e:
        if is_fatal(e):
            raise RedisUnusable(url, e) from e
        if looks_cut_by_tls(url, e) and (bad := diagnose_tls(settings, url)) is not None:
            raise bad from e
        return False
    finally:
        r.close()


def diagnose_tls(settings: Settings, url: str, timeout_s: float = 1.0) -> RedisUnusable | None:
    """After ``looks_cut_by_tls``: a handshake and a read of our own, with the same files,
    hear the server's verdict (an alert such as certificate-required) that redis-py may
    have missed. RedisUnusable for a TLS error; None when the TLS set-up is fine (the
    server waits for a command: the read times out) or the server is simply away."""
    kw = redis_kwargs(settings, url)
    try:
        parts = urlsplit(url)
        host, port = parts.hostname or "localhost", parts.port or 6379
    except ValueError:
        return None
    ctx = ssl.create_default_context()
    if kw.get("ssl_cert_reqs") == "none":
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    try:
        if kw.get("ssl_certfile"):
            ctx.load_cert_chain(kw["ssl_certfile"], kw.get("ssl_keyfile"))
        if kw.get("ssl_ca_certs"):
            ctx.load_verify_locations(cafile=kw["ssl_ca_certs"])
        with socket.create_connection((host, port), timeout=timeout_s) as raw, \
                ctx.wrap_socket(raw, server_hostname=host) as tls:
            tls.settimeout(timeout_s)
            tls.recv(1)
    except ssl.SSLError as e:
        return None if isinstance(e, SSL_TRANSIENT) else RedisUnusable(url, e)
    except OSError:  # timed out (all is well), refused, reset: nothing to tell
        return None
    return None


# ---------------------------------------------------------------- Settings -> kwargs

def _read_password_file(path: str) -> str:
    """The secret file's content less its trailing newline (``echo pw > file``, Docker and
    Kubernetes secrets); leading/trailing spaces are part of the password."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise RedisSetupError(f"PAGEDQ_REDIS_PASSWORD_FILE {path!r}: cannot read it: "
                              f"{_os_reason(e)}") from None
    text = text.removesuffix("\n").removesuffix("\r")
    if not text:
        raise RedisSetupError(f"PAGEDQ_REDIS_PASSWORD_FILE {path!r} is empty")
    return text


def _os_reason(e: BaseException) -> str:
    return e.strerror if isinstance(e, OSError) and e.strerror else str(e)


def _check_readable(name: str, path: str) -> None:
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        raise RedisSetupError(f"{name} {path!r}: cannot read it: {_os_reason(e)}") from None


def _check_tls_files(s: Settings) -> None:
    """Each file readable and what it should be (a CA bundle; a certificate with its
    key), so a mistake is one clear line at start, not an SSL error at the first call."""
    for name, path in (("PAGEDQ_REDIS_TLS_CA", s.redis_tls_ca),
                       ("PAGEDQ_REDIS_TLS_CERT", s.redis_tls_cert),
                       ("PAGEDQ_REDIS_TLS_KEY", s.redis_tls_key)):
        if path:
            _check_readable(name, path)
    if s.redis_tls_key and not s.redis_tls_cert:
        raise RedisSetupError("PAGEDQ_REDIS_TLS_KEY is set without PAGEDQ_REDIS_TLS_CERT: "
                              "give the client certificate too")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if s.redis_tls_ca:
        try:
            ctx.load_verify_locations(cafile=s.redis_tls_ca)
        except ssl.SSLError as e:
            raise RedisSetupError(f"PAGEDQ_REDIS_TLS_CA {s.redis_tls_ca!r}: not a PEM CA "
                                  f"certificate ({e.reason or e})") from None
    if s.redis_tls_cert:
        try:
            ctx.load_cert_chain(s.redis_tls_cert, s.redis_tls_key)
        except ssl.SSLError as e:
            raise RedisSetupError(
                f"PAGEDQ_REDIS_TLS_CERT {s.redis_tls_cert!r} / PAGEDQ_REDIS_TLS_KEY "
                f"{s.redis_tls_key!r}: not a PEM certificate and its private key "
                f"({e.reason or e})") from None


def redis_kwargs(settings: Settings, url: str | None = None) -> dict[str, Any]:
    """Keyword arguments for ``from_url(url, **kw)`` (sync or asyncio redis-py, a client
    or a pool) carrying the credentials and TLS files of ``settings``; ``url`` defaults
    to ``settings.redis_url``. Raises RedisSetupError for settings that cannot be used."""
    s = settings
    url = url or s.redis_url
    scheme = url.partition("://")[0].lower()
    kw: dict[str, Any] = {}

    password = s.redis_password.get_secret_value() if s.redis_password else None
    if password is not None and s.redis_password_file:
        raise RedisSetupError("both PAGEDQ_REDIS_PASSWORD and PAGEDQ_REDIS_PASSWORD_FILE are "
                              "set: give the password once")
    if s.redis_password_file:
        password = _read_password_file(s.redis_password_file)
    try:
        parts = urlsplit(url)
        url_user, url_password = parts.username, parts.password
    except ValueError:  # the URL check (redis-py's parser) reports it
        url_user = url_password = None
    if password is not None:
        if url_password:
            where = "PAGEDQ_REDIS_PASSWORD" + ("_FILE" if s.redis_password_file else "")
            raise RedisSetupError(f"the Redis password is given twice, in the URL "
                                  f"({redact_url(url)}) and in {where}: give it once")
        kw["password"] = password
    if s.redis_username:
        if url_user and unquote(url_user) != s.redis_username:
            raise RedisSetupError(f"the Redis user is given twice, in the URL "
                                  f"({redact_url(url)}) and in PAGEDQ_REDIS_USERNAME "
                                  f"({s.redis_username!r}): give it once")
        kw["username"] = s.redis_username

    tls_files = s.redis_tls_ca or s.redis_tls_cert or s.redis_tls_key
    if scheme != "rediss":
        if tls_files or s.redis_tls_insecure:
            raise RedisSetupError(f"PAGEDQ_REDIS_TLS_* settings are set but the Redis URL "
                                  f"({redact_url(url)}) is not rediss://: use a rediss:// "
                                  f"URL for TLS, or unset them")
        return kw
    _check_tls_files(s)
    if s.redis_tls_ca:
        kw["ssl_ca_certs"] = s.redis_tls_ca
    if s.redis_tls_cert:
        kw["ssl_certfile"] = s.redis_tls_cert
        kw["ssl_keyfile"] = s.redis_tls_key  # None: the key is in the certificate file
    if s.redis_tls_insecure:  # no verification of the server: for tests, never production
        kw["ssl_cert_reqs"] = "none"
        kw["ssl_check_hostname"] = False
    else:
        kw["ssl_cert_reqs"] = "required"
    return kw


def check_offline(settings: Settings, url: str | None = None) -> None:
    """All that can be checked without connecting (the URL parses, the password file and
    TLS files can be read and are what they should be); RedisSetupError otherwise."""
    url = url or settings.redis_url
    kw = redis_kwargs(settings, url)
    try:
        redis.ConnectionPool.from_url(url, **kw)  # parses only, connects later
    except (ValueError, TypeError) as e:
        raise RedisSetupError(f"--redis-url / PAGEDQ_REDIS_URL {redact_url(url)!r}: "
                              f"{' '.join(str(e).split())}") from None


def connect(settings: Settings, url: str | None = None, *, cluster: bool | None = None,
            **options: Any) -> redis.Redis:
    """A synchronous client for ``url`` (default: the settings') with the settings'
    credentials and TLS; ``options``: more redis-py client options. With
    ``settings.redis_cluster`` (or ``cluster=True``) a ``redis.cluster.RedisCluster``
    that starts from the URL's node (see ``connect_cluster``); ``cluster=False``: a plain
    client whatever the settings (rq's queue, which cannot use a cluster)."""
    url = url or settings.redis_url
    if settings.redis_cluster if cluster is None else cluster:
        return connect_cluster(settings, url, **options)
    return redis.Redis.from_url(url, **redis_kwargs(settings, url), **options)


# ---------------------------------------------------------------- Redis Cluster

def _cluster_url(url: str) -> str:
    """The URL less a ``/0`` database path (a cluster has database 0 only)."""
    parts = urlsplit(url)
    if parts.path not in ("", "/", "/0"):
        raise RedisSetupError(f"--redis-url / PAGEDQ_REDIS_URL {redact_url(url)!r}: a Redis "
                              f"Cluster has database 0 only (PAGEDQ_REDIS_CLUSTER is set)")
    return parts._replace(path="").geturl()


def connect_cluster(settings: Settings, url: str | None = None, **options: Any) -> Any:
    """A ``redis.cluster.RedisCluster`` whose start-up node is the URL's: it reads the
    slot map from it, talks to each slot's master, follows MOVED/ASK, and after a
    connection error or CLUSTERDOWN (a master failing over) reloads the map and retries
    (redis-py's own cluster retry). It connects here; a cluster it cannot reach is a
    redis.ConnectionError (refused credentials: RedisUnusable)."""
    from redis.cluster import RedisCluster

    url = url or settings.redis_url
    with _cluster_start(url):
        return cluster_keys.install(RedisCluster.from_url(
            _cluster_url(url), **redis_kwargs(settings, url), **options))


@contextlib.contextmanager
def _cluster_start(url: str) -> Iterator[None]:
    """What a cluster client's failed start means to our retry loops: RedisUnusable when a
    node refused the credentials or TLS, else (no node gave a slot map) a
    redis.ConnectionError, which they retry."""
    from redis.exceptions import RedisClusterException

    try:
        yield
    except RedisClusterException as e:
        cause = e.__cause__ or e.__context__
        if cause is not None and is_fatal(cause):
            raise RedisUnusable(url, cause) from e
        raise redis.ConnectionError(f"cannot reach the Redis Cluster at {redact_url(url)}: "
                                    f"{' '.join(str(e).split())}") from e
    except redis.RedisError as e:
        if is_fatal(e):
            raise RedisUnusable(url, e) from e
        raise


async def start_async_cluster(r: Any, url: str) -> None:
    """Load the slot map of an asyncio cluster client ``r`` (``connect_async``,
    ``client_redis``) and connect to its nodes: what redis-py does lazily at the first
    command. Its callers run it once, under a lock, before the client's first command
    (producer/aio.py): redis-py's lazy start entered by many tasks at once failed some of
    them (``'NoneType' object has no attribute 'writelines'``). Errors as
    ``connect_cluster``'s."""
    with _cluster_start(url):
        await r.initialize()


def connect_async(settings: Settings, url: str | None = None, **options: Any) -> Any:
    """``connect``'s asyncio twin (a ``redis.asyncio`` client, or its cluster client with
    ``settings.redis_cluster``); it connects on first use."""
    url = url or settings.redis_url
    if settings.redis_cluster:
        from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster

        return cluster_keys.install(AsyncRedisCluster.from_url(
            _cluster_url(url), **redis_kwargs(settings, url), **options))
    import redis.asyncio as aredis

    return aredis.Redis.from_url(url, **redis_kwargs(settings, url), **options)


def client_redis(settings: Settings, pool: dict[str, Any], asyncio: bool = False) -> Any:
    """The producer clients' connection (producer/reader.py ``client_setup`` builds
    ``pool``): a client on a BlockingConnectionPool, or with ``settings.redis_cluster`` a
    cluster client with the same options (at most ``max_connections`` per node; it connects
    on first use when asyncio)."""
    if settings.redis_cluster:
        opts = {k: v for k, v in pool.items() if k not in ("url", "timeout")}
        if asyncio:
            from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster

            return cluster_keys.install(AsyncRedisCluster.from_url(_cluster_url(pool["url"]),
                                                                   **opts))
        return connect_cluster(settings, pool["url"], **{k: v for k, v in opts.items()
                                                         if k not in redis_kwargs(
                                                             settings, pool["url"])})
    if asyncio:
        import redis.asyncio as aredis

        return aredis.Redis(connection_pool=aredis.BlockingConnectionPool.from_url(**pool))
    return redis.Redis(connection_pool=redis.BlockingConnectionPool.from_url(**pool))


def is_cluster(r: Any) -> bool:
    """Is ``r`` a cluster client (sync or asyncio)? Its commands must each name keys of one
    slot, and a pipeline of it is split per node (no MULTI across partitions)."""
    from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
    from redis.cluster import RedisCluster

    return isinstance(r, RedisCluster | AsyncRedisCluster)


def is_cluster_pubsub(ps: Any) -> bool:
    """Is ``ps`` a cluster client's pub/sub object (sync or asyncio)? It subscribes to
    the scripts' shard channels (SSUBSCRIBE, pagedq.wire.lua.sharded)."""
    from redis.asyncio.cluster import ClusterPubSub as AsyncClusterPubSub
    from redis.cluster import ClusterPubSub

    return isinstance(ps, ClusterPubSub | AsyncClusterPubSub)
