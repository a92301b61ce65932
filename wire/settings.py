"""Every service-side default in one place. Each field is overridable by the environment
variable PAGEDQ_<NAME> (e.g. PAGEDQ_REDIS_URL) or by the matching CLI flag.

Engine defaults (block size, token budget, ...) live in engine/config.py; the worker
maps PAGEDQ_ENGINE_* style CLI flags onto it.
"""
from __future__ import annotations

from typing import Annotated

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from .keys import MAX_PARTITIONS, check_lane, check_name


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PAGEDQ_", extra="ignore")

    redis_url: str = "redis://127.0.0.1:6379/0"
    # Redis credentials and TLS (docs/deployment.md "TLS and secrets"; wire/connection.py
    # turns them into redis-py's arguments for every connection). The password need never
    # be on a command line: PAGEDQ_REDIS_PASSWORD, or PAGEDQ_REDIS_PASSWORD_FILE (a Docker or
    # Kubernetes secret file, read at start), or the URL; only one of them.
    redis_username: str | None = None  # an ACL user (default: the URL's, else "default")
    redis_password: SecretStr | None = None
    redis_password_file: str | None = None
    # TLS needs a rediss:// URL; the files are PEM paths
    redis_tls_ca: str | None = None  # CA of the server's certificate (default: the system's)
    redis_tls_cert: str | None = None  # client certificate (for tls-auth-clients yes)
    redis_tls_key: str | None = None  # its private key (default: in the certificate file)
    redis_tls_insecure: bool = False  # skip verifying the server's certificate: tests only
    # the URL names one node of a Redis Cluster: clients and workers use redis-py's cluster
    # client, which finds the other nodes and follows MOVED/ASK (docs/deployment.md)
    redis_cluster: bool = False
    prefix: str = "pagedq"
    # key spaces of every prefix (one Redis Cluster slot each): jobs are spread over them
    # and workers serve all of them; every producer, worker, gateway and batch process of
    # a deployment must use the same number (docs/protocol.md "Partitions")
    partitions: int = Field(1, ge=1, le=MAX_PARTITIONS)
    # the tenants a worker serves: their key prefixes (comma-separated in the environment:
    # PAGEDQ_PREFIXES=a,b); empty = just ``prefix``. Clients use ``prefix`` alone
    # (docs/security.md "Tenants").
    prefixes: Annotated[tuple[str, ...], NoDecode] = ()
    model: str = "smollm2"  # served model name = jobs stream name

    # lanes: the jobs streams of a model, highest first (comma-separated in the environment:
    # PAGEDQ_LANES=urgent,interactive,batch). A worker fills free seats from the highest lane
    # with work; a lower lane only gets what the higher ones leave, except that each lane
    # below the first keeps at least lane_min_share of a worker's seats while it has work,
    # so its oldest job waits a bounded time (docs/design.md "Lanes").
    lanes: Annotated[tuple[str, ...], NoDecode] = ("interactive", "batch")
    lane_min_share: float = Field(0.1, ge=0, le=0.5)

    # clients: each concurrent stream()/result() wait holds one connection; past this many
    # a call waits for a free connection (redis-py's own default, 100, raises instead)
    client_max_connections: int = Field(1024, ge=1)
    # clients: how long one call keeps retrying connection failures (a Redis restart,
    # LOADING while it reads its AOF) with capped exponential backoff; 0 = no retry
    client_retry_s: float = Field(30.0, ge=0)

    # results and event logs
    result_ttl_s: int = Field(86400, ge=1)  # job hash + out stream TTL after the job ends
    out_maxlen: int = Field(10000, ge=10)  # approximate cap of a job's out stream
    stream_idle_ttl_s: int = Field(3600, ge=10)  # out stream TTL while running, refreshed

    # recovery
    lease_s: float = Field(30.0, gt=0)  # entry idle time after which another worker may claim it
    max_deliveries: int = Field(3, ge=1)  # attempts before a job goes to the DLQ
    heartbeat_ttl_s: float = Field(15.0, gt=0)
    # a queued job of a model no live worker serves expires after this long (0 = never)
    unserved_timeout_s: float = Field(3600.0, ge=0)
    # dead-letter entries are kept this long (trimmed by entry age; bodies truncated)
    dlq_ttl_s: int = Field(7 * 86400, ge=60)

    # backpressure (producer side refuses with Overloaded past these; 0 = unlimited)
    max_queued_jobs: int = Field(0, ge=0)
    max_queued_tokens: int = Field(0, ge=0)

    # intake: while the engine is busy and the stream had nothing new, look again only after
    # this long (the engine thread's Redis round trips compete with Redis serving clients)
    intake_poll_ms: float = Field(10.0, ge=0)

    # publishing
    # with >= coalesce_min_batch jobs in a step, hold their deltas coalesce_ms so the next
    # step's merge into the same events (H200 service bench, 256 jobs: 2.3-2.4 tokens per
    # event, redis-server CPU -27..42%, throughput +1%); 0 = an event per job per step
    coalesce_ms: float = Field(10.0, ge=0)
    coalesce_min_batch: int = Field(64, ge=1)

    # worker shutdown
    drain_timeout_s: float = Field(30.0, ge=0)
    # a step longer than this (or 20x the slowest recent steps, if more) is a wedged engine
    step_watchdog_s: float = Field(120.0, gt=0)
    # keep engine steps about this short on slow devices by chunking prefills finer, so
    # leases and heartbeats are refreshed between steps (0 = never lower the token budget)
    max_step_s: float = Field(2.0, ge=0)
    # refuse a prompt whose estimated prefill on this worker takes longer (0 = no limit;
    # a job with a deadline is also refused when the estimate passes its deadline)
    max_prefill_s: float = Field(0.0, ge=0)
    metrics_port: int = Field(0, ge=0)  # 0 = no HTTP metrics endpoint
    metrics_host: str = "127.0.0.1"  # address the metrics endpoint binds (0.0.0.0 = all)
    # the metrics endpoint's /healthz and /readyz answer 503 once the engine loop has not
    # run for this long (a wedged step; worker/health.py); keep it under step_watchdog_s
    health_max_silence_s: float = Field(60.0, gt=0)

    @property
    def served_prefixes(self) -> tuple[str, ...]:
        """The prefixes a worker serves, ``prefixes`` or else ``(prefix,)``."""
        return self.prefixes or (self.prefix,)

    @field_validator("prefixes", mode="before")
    @classmethod
    def _prefixes(cls, v: object) -> object:
        if isinstance(v, str):
            v = tuple(x.strip() for x in v.split(",") if x.strip())
        if not isinstance(v, list | tuple):
            raise ValueError("prefixes must be a comma-separated list of prefixes")
        if len(set(v)) != len(v):
            raise ValueError(f"prefixes must be distinct: {','.join(v)}")
        return tuple(check_name("prefix", x) for x in v)

    @field_validator("lanes", mode="before")
    @classmethod
    def _lanes(cls, v: object) -> object:
        if isinstance(v, str):
            v = tuple(x.strip() for x in v.split(",") if x.strip())
        if not isinstance(v, list | tuple) or not v:
            raise ValueError("lanes must name at least one lane")
        if len(set(v)) != len(v):
            raise ValueError(f"lanes must be distinct: {','.join(v)}")
        return tuple(check_lane(x) for x in v)
