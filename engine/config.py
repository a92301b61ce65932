"""The engine's configuration, ``EngineConfig``: every engine default, validated with clear
errors. It is declared in wire/engine_config.py (each setting once: type, default, help,
allowed values), where `pagedq`'s command line reads it without importing the engine."""
from pagedq.wire.engine_config import EngineConfig

__all__ = ["EngineConfig"]
