"""The gateway's own settings (environment ``PAGEDQ_GATEWAY_<NAME>``, or the matching
``pagedq gateway`` flag). The Redis URL, the default prefix and model are wire/settings.py's
(PAGEDQ_REDIS_URL, PAGEDQ_PREFIX, PAGEDQ_MODEL); the batch folder is batch/settings.py's
(PAGEDQ_BATCH_DIR)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PAGEDQ_GATEWAY_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    workers: int = Field(1, ge=1, le=256)  # uvicorn processes
    # auto: keys are required as soon as the key store holds one (none: every request is
    # the default tenant, PAGEDQ_PREFIX); on: always required; off: never (no rate limits)
    auth: Literal["auto", "on", "off"] = "auto"
    # JSON lines {"sha256", "tenant", "rpm", "tpm", "name"} instead of the Redis key store
    # ({PAGEDQ_PREFIX}:apikeys); read at start
    keys_file: str = ""
    # the gateway's own log lines (stderr; never a key, a prompt or an output) and uvicorn's
    log_level: Literal["debug", "info", "warning", "error", "critical"] = "info"
    # Retry-After of a 429 for a full queue (PAGEDQ_MAX_QUEUED_JOBS/_TOKENS)
    overloaded_retry_after_s: int = Field(1, ge=1)
    # an uploaded file (POST /v1/files) is deleted this long after its upload, as OpenAI
    # deletes batch input files after 30 days; 0 = kept until deleted
    upload_ttl_s: int = Field(30 * 86400, ge=0)
    # the bytes of uploaded files a tenant may keep at once (an upload past it: 400); 0 = no cap
    upload_quota_bytes: int = Field(10 * 2**30, ge=0)
