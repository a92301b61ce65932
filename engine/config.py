"""The engine's configuration, ``EngineConfig``: every engine default, validated with clear
errors. It is declared in wire/engine_config.py (each setting once: type, default, help,
allowed values), where `pagedq`'s command line reads it without importing the engine."""
from typing import Any

from pagedq.wire.engine_config import EngineConfig

__all__ = ["EngineConfig", "engine_config"]


def engine_config(config: EngineConfig | None, options: dict[str, Any]) -> EngineConfig:
    """``config`` itself (validated when it was constructed: never again), or one
    constructed from ``options`` (LLMEngine's keyword arguments); not both."""
    if config is None:
        return EngineConfig(**options)
    if options:
        raise TypeError(f"pass config= or the settings ({', '.join(options)}), not both")
    return config
