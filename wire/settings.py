"""Every service-side setting in one place, each declared once: its type, default, range
and description. Each field is overridable by the environment variable PAGEDQ_<NAME>
(e.g. PAGEDQ_REDIS_URL) or by the matching CLI flag.

The engine's settings (block size, token budget, ...) are declared in wire/engine_config.py,
the worker process's own in worker/settings.py.
"""
from __future__ import annotations

from typing import Annotated

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from .keys import MAX_PARTITIONS, check_lane, check_name


class Settings(BaseSettings):
    """Each field's description is what docs/configuration.md says of it (generated,
    worker/config_doc.py) and what its flag's help says, where it has one."""

    model_config = SettingsConfigDict(env_prefix="PAGEDQ_", extra="ignore")

    redis_url: str = Field("redis://127.0.0.1:6379/0", description=(
        "the Redis to use (`redis://`, `rediss://` for TLS, `unix://`)"))
    # Redis credentials and TLS (docs/deployment.md "TLS and secrets"; wire/connection.py
    # turns them into redis-py's arguments for every connection). The password need never
    # be on a command line: PAGEDQ_REDIS_PASSWORD, or PAGEDQ_REDIS_PASSWORD_FILE (a Docker or
    # Kubernetes secret file, read at start), or the URL; only one of them.
    redis_username: str | None = Field(None, description=(
        "Redis ACL user; `null`: the URL's, else `default`"))
    redis_password: SecretStr | None = Field(None, description=(
        "Redis password (never printed: `pagedq config` shows `**********`); or the URL's, "
        "or redis_password_file"))
    redis_password_file: str | None = Field(None, description=(
        "a file holding the Redis password (a Docker or Kubernetes secret), read at start"))
    # TLS needs a rediss:// URL; the files are PEM paths
    redis_tls_ca: str | None = Field(None, description=(
        "PEM file of the CA of the server's certificate; `null`: the system's"))
    redis_tls_cert: str | None = Field(None, description=(
        "PEM client certificate (for `tls-auth-clients yes`)"))
    redis_tls_key: str | None = Field(None, description=(
        "its private key; `null`: in the certificate file"))
    redis_tls_insecure: bool = Field(False, description=(
        "skip verifying the server's certificate (tests only)"))
    redis_cluster: bool = Field(False, description=(
        "the URL names one node of a Redis Cluster: every client and the worker use "
        "redis-py's cluster client (docs/deployment.md \"Redis Cluster\")"))
    prefix: str = Field("pagedq", description=(
        "key prefix of the deployment (every key carries `{prefix}`, or `{prefix:p<k>}` in "
        "partition k)"))
    partitions: int = Field(1, ge=1, le=MAX_PARTITIONS, description=(
        "key spaces of every prefix, one Redis Cluster slot each (1..1024): jobs are spread "
        "over them, workers serve them all; the same on every producer, worker, gateway and "
        "batch process (docs/protocol.md \"Partitions\")"))
    prefixes: Annotated[tuple[str, ...], NoDecode] = Field((), description=(
        "the tenants a worker serves: their key prefixes (a list in YAML, comma-separated in "
        "the environment); `[]`: just `prefix` (docs/security.md \"Tenants\"). Clients use "
        "`prefix` alone"))
    model: str = Field("smollm2", description="served model name = jobs stream name")

    # lanes: a worker fills free seats from the highest lane with work; a lower lane only
    # gets what the higher ones leave, except that each lane below the first keeps at least
    # lane_min_share of a worker's seats while it has work, so its oldest job waits a
    # bounded time (docs/design.md "Lanes")
    lanes: Annotated[tuple[str, ...], NoDecode] = Field(("interactive", "batch"), description=(
        "the lanes (jobs streams) served, highest first; a list in YAML, comma-separated in "
        "the environment"))
    lane_min_share: float = Field(0.1, ge=0, le=0.5, description=(
        "seats each lower lane keeps while it has work, as a share of max_num_seqs (0..0.5)"))

    # past client_max_connections a call waits for a free connection (redis-py's own
    # default, 100, raises instead); each concurrent stream()/result() wait holds one
    client_max_connections: int = Field(1024, ge=1, description=(
        "clients: connections in the pool; past this many a call waits for one"))
    # a Redis restart, LOADING while it reads its AOF: retried with capped exponential backoff
    client_retry_s: float = Field(30.0, ge=0, description=(
        "clients: how long a call retries connection failures; 0 = no retry"))

    # results and event logs
    result_ttl_s: int = Field(86400, ge=1, description=(
        "TTL of a job's hash and out stream after the job ends"))
    cancelled_ttl_s: int = Field(600, ge=1, description=(
        "TTL of the record of a job cancelled while queued (it has no out stream)"))
    out_maxlen: int = Field(10000, ge=10, description=(
        "approximate cap of a job's out stream (>= 10)"))
    stream_idle_ttl_s: int = Field(3600, ge=10, description=(
        "TTL of an out stream while its job runs, refreshed"))

    # recovery
    lease_s: float = Field(30.0, gt=0, description=(
        "idle time of a job's entry after which another worker may claim it"))
    max_deliveries: int = Field(3, ge=1, description=(
        "starts of a job before it goes to the DLQ"))
    heartbeat_ttl_s: float = Field(15.0, gt=0, description="TTL of the worker's heartbeat")
    unserved_timeout_s: float = Field(3600.0, ge=0, description=(
        "a queued job of a model no live worker serves expires after this long; 0 = never"))
    # trimmed by entry age; bodies truncated
    dlq_ttl_s: int = Field(7 * 86400, ge=60, description=(
        "dead-letter entries are kept this long (>= 60)"))

    # backpressure (producer side refuses with Overloaded past these; 0 = unlimited)
    max_queued_jobs: int = Field(0, ge=0, description=(
        "producers: refuse a submit (Overloaded) past this many queued jobs; 0 = unlimited"))
    max_queued_tokens: int = Field(0, ge=0, description=(
        "producers: refuse a submit past this many queued prompt tokens; 0 = unlimited"))

    # intake: the engine thread's Redis round trips compete with Redis serving clients
    intake_poll_ms: float = Field(10.0, ge=0, description=(
        "a busy worker looks for new jobs this often once the first lane has run dry"))

    # publishing (H200 service bench, 256 jobs: 2.3-2.4 tokens per event, redis-server CPU
    # -27..42%, throughput +1%)
    coalesce_ms: float = Field(10.0, ge=0, description=(
        "with >= coalesce_min_batch jobs in a step, hold their tokens this long so one event "
        "carries a few steps'; 0 = an event per step"))
    coalesce_min_batch: int = Field(64, ge=1, description=(
        "jobs in a step from which tokens are coalesced"))

    # worker shutdown
    drain_timeout_s: float = Field(30.0, ge=0, description=(
        "on SIGTERM, finish running jobs for at most this long, then hand them back"))
    step_watchdog_s: float = Field(120.0, gt=0, description=(
        "an engine step longer than this (or 20x the slowest recent ones) is wedged: exit 70"))
    # chunking prefills finer on slow devices keeps leases and heartbeats refreshed
    max_step_s: float = Field(2.0, ge=0, description=(
        "keep steps about this short on slow devices by chunking prefills finer; 0 = never"))
    # a job with a deadline is also refused when the estimate passes its deadline
    max_prefill_s: float = Field(0.0, ge=0, description=(
        "refuse a prompt whose estimated prefill takes longer; 0 = no limit"))
    metrics_port: int = Field(0, ge=0, description=(
        "serve Prometheus metrics on this port; 0 = off"))
    metrics_host: str = Field("127.0.0.1", description=(
        "address the metrics endpoint binds; `0.0.0.0` = every interface"))
    # a wedged step (worker/health.py); keep it under step_watchdog_s
    health_max_silence_s: float = Field(60.0, gt=0, description=(
        "/healthz and /readyz answer 503 once the engine loop has not run for this long"))

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
