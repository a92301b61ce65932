"""The worker process's own settings (the model it loads and the name it serves it under,
its consumer id, its log level), declared once like the engine's (wire/declared.py), and
``WorkerSettings``: those and the engine's (wire/engine_config.py) as one pydantic-settings
model, which reads each from the environment as PAGEDQ_<NAME> and checks its type. Their
values are checked by their declarations (``declared.check``: once, wherever a value came
from). The service settings it shares with clients (Redis, prefix, lanes, leases, ...) are
wire/settings.py's ``Settings``; worker/config.py layers both (flag > environment > config
file > default) and docs/configuration.md lists every one.

No torch and no engine import: the CLI's parser and `pagedq config` use this module.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import create_model, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from pagedq.wire.declared import Declared, declared, setting
from pagedq.wire.engine_config import EngineConfig

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


@dataclass(slots=True)
class ProcessConfig:
    model: str = setting(
        "smollm2", "model", "the model to load: `smollm2` (bundled), a local Hugging Face "
        "folder, or a `.gguf` file", key="path", pattern=r"(?s).*\S.*",
        pattern_help="a name, a folder or a file, not blank")
    served_name: str | None = setting(
        None, "model", "the jobs stream's model name", default_help="the model's name, or "
        "the folder/file name without `.gguf`")
    worker_id: str | None = setting(
        None, "service", "stable consumer name; a restarted worker with the same id re-reads "
        "its own pending jobs", default_help="`<hostname>-<pid>`")
    log_level: str = setting(
        "info", "service", "log level of the JSON logs on stderr", choices=LOG_LEVELS,
        flag_choices=True, lower=True)


# every declared worker setting: the process's, then the engine's (passed to LLMEngine as
# they are; seed: None becomes a random seed per process)
PROCESS = declared(ProcessConfig)
ENGINE = declared(EngineConfig)
DECLARED: dict[str, Declared] = {d.name: d for d in (*PROCESS, *ENGINE)}
ENGINE_FIELDS = tuple(d.name for d in ENGINE)


class _Base(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PAGEDQ_", extra="ignore")

    @field_validator(*(d.name for d in DECLARED.values() if d.setting.lower), mode="before",
                     check_fields=False)
    @classmethod
    def _lower(cls, v: object) -> object:
        return v.lower() if isinstance(v, str) else v


# Types only: values are checked by their declarations (worker/config.py runs the checks).
WorkerSettings: type[BaseSettings] = create_model(
    "WorkerSettings", __base__=_Base,
    **{d.name: (d.annotation, d.worker_default) for d in DECLARED.values()})


def process_config(ws: Any) -> ProcessConfig:
    return ProcessConfig(**{d.name: getattr(ws, d.name) for d in PROCESS})
