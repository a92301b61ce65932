"""One configuration of a worker from four layers, highest first:

    command-line flag  >  environment PAGEDQ_<NAME>  >  config file  >  built-in default

Settings are named once, flat (``max_num_seqs``): the environment variable is
PAGEDQ_<NAME upper-cased>, the flag ``--<name with dashes>`` (where a flag exists), the YAML
key ``<section>.<key>`` of ``sections()`` (the key is the name, except ``model.path`` and
``scheduler.policy``). The service settings are wire/settings.py's ``Settings`` (its
every field but ``model``, which the worker derives from model.path/served_name); the
process and engine settings are declared in worker/settings.py and wire/engine_config.py,
each field with its section, key, help and allowed values, and everything here is made
from those declarations. docs/configuration.md lists them all (generated:
worker/config_doc.py).

Anything wrong (a missing, unreadable or non-YAML file, an unknown section or key, a value
of the wrong type or out of range, from any layer) is a ConfigError whose one-line message
names the setting the way the user gave it: the flag, the variable, or the file and key.
No torch here: `pagedq config` and the CLI's checks run before any model loads.
"""
from __future__ import annotations

import argparse
import difflib
import os
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from pydantic_settings import BaseSettings

from pagedq.wire.declared import SECTIONS, Declared, allowed, problem
from pagedq.wire.engine_config import EngineConfig
from pagedq.wire.settings import Settings
from pagedq.worker.names import served_name
from pagedq.worker.settings import DECLARED, ENGINE_FIELDS, PROCESS, WorkerSettings

CONFIG_ENV = "PAGEDQ_CONFIG"
SOURCES = ("flag", "env", "file", "default")  # precedence, highest first

# The service settings `pagedq worker` has a flag for (the root's --redis-url and --prefix,
# and these of its own, worker/cli.py); the others are set by the environment or a file.
COMMON_FLAGS = ("redis_url", "prefix")
SERVICE_FLAGS = {"metrics_port": "PORT", "metrics_host": "HOST", "lanes": "A,B,...",
                 "prefixes": "A,B,...", "lane_min_share": "F"}  # name -> the flag's metavar
# Every setting the worker's command line sets (`--<name-with-dashes>`).
FLAGGED = frozenset({*COMMON_FLAGS, *SERVICE_FLAGS,
                     *(d.name for d in DECLARED.values() if d.setting.flag)})


class ConfigError(Exception):
    """A setting that parsed but is not allowed: exit EXIT_CONFIG with one line."""


def service_fields() -> list[str]:
    """Settings' fields a worker config sets (``model`` is derived: see the docstring)."""
    return [n for n in Settings.model_fields if n != "model"]


def sections() -> dict[str, dict[str, str]]:
    """section -> YAML key -> setting name, for every setting: the declared ones in their
    sections (wire/declared.py), then every field of Settings in ``service`` (so a field
    added there is a config setting at once)."""
    out: dict[str, dict[str, str]] = {sec: {} for sec in SECTIONS}
    out["service"].update({n: n for n in service_fields()})
    for d in DECLARED.values():
        out[d.setting.section][d.key] = d.name
    return out


def yaml_keys() -> dict[str, str]:
    """setting name -> its YAML key ``section.key``."""
    return {name: f"{sec}.{key}" for sec, keys in sections().items() for key, name in keys.items()}


def env_name(name: str) -> str:
    return "PAGEDQ_" + name.upper()


def flag_name(name: str) -> str | None:
    return "--" + name.replace("_", "-") if name in FLAGGED else None


def plain(text: str | None) -> str:
    """A declared help (Markdown) as plain text for a terminal."""
    return (text or "").replace("`", "")


def flag_default(value: Any) -> str:
    """A default as a flag's help says it."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple | list):
        return ",".join(map(str, value)) if value else "none"
    return "none" if value is None else str(value)


def flag_help(d: Declared) -> str:
    """A declared setting's flag help: what it is, what it takes (unless argparse lists the
    choices), its default and what that default means."""
    s, default = d.setting, d.worker_default
    text = plain(s.help)
    if (what := allowed(d)) and not s.flag_choices:
        text += f"; {'one of ' if s.choices else ''}{plain(what)}"
    if default is None:
        shown = s.default_help or "none"
    else:
        shown = flag_default(default) + (f" = {s.default_help}" if s.default_help else "")
    return f"{text} (default: {plain(shown)})"


def flag_argv(args: argparse.Namespace, skip: frozenset[str] = frozenset()) -> list[str]:
    """The setting flags given in ``args`` as a command line again (for a child worker)."""
    argv: list[str] = []
    for n in sorted(FLAGGED - skip):
        v = getattr(args, n, None)
        if isinstance(v, bool):
            argv.append(flag_name(n) if v else "--no-" + n.replace("_", "-"))
        elif v is not None:
            argv += [flag_name(n), str(v)]
    return argv


# ---- the config file ------------------------------------------------------------------

def config_path(args: argparse.Namespace | None) -> str | None:
    """``--config`` if given, else $PAGEDQ_CONFIG, else no file."""
    return getattr(args, "config", None) or os.environ.get(CONFIG_ENV) or None


def load_file(path: str) -> dict[str, Any]:
    """The settings a YAML config file sets: setting name -> value (types unchecked yet)."""
    import yaml  # only when a file is given

    where = f"config file {path}"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{where} is not UTF-8 text") from None
    except OSError as e:
        raise ConfigError(f"{where} cannot be read: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"{where} is not valid YAML{at}: {' '.join(problem.split())}") from None
    secs = sections()
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: the top level must be a mapping of sections "
                          f"({', '.join(sorted(secs))}), not a {type(data).__name__}")
    where_of = yaml_keys()
    out: dict[str, Any] = {}
    for sec, body in data.items():
        if sec not in secs:
            hint = f"; {sec} is {where_of[sec]}" if sec in where_of else ""
            raise ConfigError(f"{where}: unknown section {sec!r} (sections: "
                              f"{', '.join(sorted(secs))}){hint}")
        if body is None:
            continue
        if not isinstance(body, dict):
            raise ConfigError(f"{where}: section {sec} must be a mapping of key: value, "
                              f"not a {type(body).__name__}")
        for key, value in body.items():
            if key not in secs[sec]:
                raise ConfigError(f"{where}: unknown key {sec}.{key}{_hint(sec, key)}")
            out[secs[sec][key]] = value
    return out


def _hint(sec: str, key: object) -> str:
    """Where a misplaced or misspelt key belongs."""
    where_of = yaml_keys()
    if key == "model" and sec == "service":
        return " (the model is model.path, its stream name model.served_name)"
    if isinstance(key, str) and key in where_of:
        return f" (it is {where_of[key]})"
    close = difflib.get_close_matches(str(key), list(sections()[sec]), n=1)
    return f" (did you mean {sec}.{close[0]}?)" if close else \
        f" (keys of {sec}: {', '.join(sections()[sec])})"


# ---- resolution -----------------------------------------------------------------------

def _env_set(cls: type[BaseSettings], name: str) -> bool:
    """Whether pydantic-settings reads ``name`` from the environment (case-insensitive)."""
    want = (str(cls.model_config.get("env_prefix", "")) + name).lower()
    return any(k.lower() == want for k in os.environ)


# an engine field's name inside an engine message ("seed" is also a plain word there)
_ENGINE_NAME = re.compile(
    r"(?<![\w.-])(" + "|".join(sorted(set(ENGINE_FIELDS) - {"seed"}, key=len, reverse=True))
    + r")\b")


@dataclass
class Resolved:
    """The effective configuration: both settings objects, each setting's source."""

    service: Settings
    worker: WorkerSettings
    file: str | None
    sources: dict[str, str] = field(default_factory=dict)  # setting name -> SOURCES item
    # the engine's settings, validated once by check_config (worker/cli.py); build_engine
    # hands this very object to the engine
    engine: EngineConfig | None = None

    def engine_kwargs(self) -> dict[str, Any]:
        """LLMEngine/EngineConfig keyword arguments."""
        kw = {n: getattr(self.worker, n) for n in ENGINE_FIELDS}
        if kw["seed"] is None:
            kw["seed"] = secrets.randbits(63)
        return kw

    def value(self, name: str) -> Any:
        if name == "served_name":
            return self.service.model
        src = self.worker if name in WorkerSettings.model_fields else self.service
        return getattr(src, name)

    def origin(self, name: str) -> str:
        return origin(name, self.sources.get(name, "default"), self.file)

    def explain(self, msg: str) -> str:
        """An engine message in the user's words, one line: each engine setting named in it
        becomes the flag, variable or file key that set it (a default: its flag and value)."""
        def said(n: str) -> str:
            if self.sources.get(n, "default") != "default":
                return self.origin(n)
            return f"{flag_name(n)} (default {self.value(n)})"

        # a declared setting's own check names it first (wire/declared.py), "seed" too
        head, sep, rest = msg.partition(" must ")
        lead = ""
        if sep and head in ENGINE_FIELDS:
            lead, msg = f"{said(head)} must ", rest
        return " ".join((lead + _ENGINE_NAME.sub(lambda m: said(m[1]), msg)).split())

def origin(name: str, source: str, file: str | None) -> str:
    """How the user named a setting: the flag, PAGEDQ_<NAME>, or the file's key."""
    if source == "env":
        return env_name(name)
    if source == "file":
        return f"{yaml_keys().get(name, name)} in {file}"
    return flag_name(name) or env_name(name)


def resolve(args: argparse.Namespace | None = None) -> Resolved:
    """The layers merged: flags (``args``' attributes that are not None) > environment >
    the config file (``--config`` / $PAGEDQ_CONFIG) > defaults. Raises ConfigError."""
    path = config_path(args)
    from_file = load_file(path) if path else {}
    flags = {n: v for n in FLAGGED if (v := getattr(args, n, None)) is not None}
    sources: dict[str, str] = {}
    errors: list[str] = []

    def build(cls: type[BaseSettings], names: list[str], extra: dict[str, Any]):
        kw: dict[str, Any] = {}
        for n in names:
            if n in flags:
                kw[n], sources[n] = flags[n], "flag"
            elif _env_set(cls, n):
                sources[n] = "env"  # pydantic-settings reads (and decodes) it
            elif n in from_file:
                kw[n], sources[n] = from_file[n], "file"
            else:
                sources[n] = "default"
        try:
            return cls(**kw, **extra)
        except ValidationError as e:
            errors.extend(_describe(err, sources, path) for err in e.errors())
            return None

    worker = build(WorkerSettings, list(WorkerSettings.model_fields), {})
    served = served_name(worker.model, worker.served_name) if worker else "x"
    service = build(Settings, service_fields(), {"model": served})
    if errors:
        raise ConfigError("bad setting: " + "; ".join(errors))
    for d in PROCESS:  # the engine's are checked with its rules between settings (check_config)
        if (why := problem(d, getattr(worker, d.name))) is not None:
            raise ConfigError(origin(d.name, sources[d.name], path) + why[len(d.name):])
    return Resolved(service, worker, path, sources)


def _describe(err: dict, sources: dict[str, str], file: str | None) -> str:
    """One pydantic error: which setting (as the user gave it), what is wrong, the value."""
    name = str(err["loc"][0]) if err.get("loc") else "?"
    source = sources.get(name, "default")
    where = origin(name, source, file)
    if source == "flag":  # the variable too: the same setting under its other name
        where = f"{where} / {env_name(name)}"
    msg = str(err["msg"]).removeprefix("Value error, ")
    got = err.get("input")
    if isinstance(got, dict) or _secret(name):  # never echo a password
        return f"{where}: {msg}"
    return f"{where}: {msg} (got {got!r})"


def _secret(name: str) -> bool:
    f = Settings.model_fields.get(name) or WorkerSettings.model_fields.get(name)
    return "password" in name or "secret" in name or "SecretStr" in str(f and f.annotation)
