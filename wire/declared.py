"""Settings declared once: a dataclass field that carries, beside its type and default,
everything said about it anywhere (``Setting``): its help, its allowed values, its YAML
section and key, whether `pagedq worker` has a flag for it. The engine's configuration
(wire/engine_config.py) and the worker's own settings (worker/settings.py) are declared
this way; the worker derives its flags, its environment variables (PAGEDQ_<NAME>), its
config file's keys, `pagedq config` and docs/configuration.md from the declarations
(worker/config.py, worker/config_doc.py), and ``check`` is the one validation of every
value, wherever it came from. Standard library only: the engine imports this.

    block_size: int = setting(16, "cache", "tokens per KV block", choices=(8, 16, 32))
"""
from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal, get_args, get_origin

SECTIONS = ("model", "scheduler", "cache", "service")  # the config file's, in this order


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"


_UNSET: Any = _Unset()


@dataclass(frozen=True, slots=True)
class Setting:
    """What a setting's field declares besides its type and default.

    ``help`` says what it is (Markdown: `code` in backticks, dropped in the flag's help);
    ``default_help`` what its default means where the value alone does not say (None:
    "the model's context length"); ``choices``, ``low``/``high`` (``*_open``: the bound
    itself excluded) and ``pattern`` (a full match, ``pattern_help`` naming what it
    matches) what values it takes. ``flag``: `pagedq worker --<name>` sets it;
    ``flag_choices``: that flag refuses other values itself (a usage error, exit 2; else
    the value is checked with the others, exit 78). ``lower``: values are case-insensitive.
    ``worker_default``: a worker's default, where it differs from the field's."""

    section: str
    help: str
    key: str | None = None  # the YAML key; None: the name
    default_help: str = ""
    choices: tuple[Any, ...] = ()
    low: float | None = None
    low_open: bool = False
    high: float | None = None
    high_open: bool = False
    pattern: str = ""
    pattern_help: str = ""
    flag: bool = True
    flag_choices: bool = False
    metavar: str | None = None
    lower: bool = False
    worker_default: Any = _UNSET

    def __post_init__(self) -> None:
        if self.section not in SECTIONS:
            raise ValueError(f"section {self.section!r}: one of {', '.join(SECTIONS)}")


def setting(default: Any, section: str, help: str, **kw: Any) -> Any:
    """A dataclass field of this default and its ``Setting``."""
    return dataclasses.field(default=default, metadata={"setting": Setting(section, help, **kw)})


@dataclass(frozen=True, slots=True)
class Declared:
    """One declared setting: its name, type (``base``: the type without None), field
    default and Setting."""

    name: str
    base: type
    optional: bool
    default: Any
    setting: Setting
    owner: type  # the dataclass declaring it

    @property
    def worker_default(self) -> Any:
        wd = self.setting.worker_default
        return self.default if wd is _UNSET else wd

    @property
    def key(self) -> str:
        return self.setting.key or self.name

    @property
    def annotation(self) -> Any:
        return self.base | None if self.optional else self.base


def declared(cls: type) -> list[Declared]:
    """The declared settings of dataclass ``cls``, in declaration order."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        s = f.metadata.get("setting")
        if s is None:
            continue
        tp, optional = hints[f.name], False
        if get_origin(tp) in (typing.Union, types.UnionType):
            args = [a for a in get_args(tp) if a is not type(None)]
            optional = len(args) < len(get_args(tp))
            tp = args[0]
        if get_origin(tp) is Literal:
            raise TypeError(f"{cls.__name__}.{f.name}: declare choices=, not a Literal type")
        out.append(Declared(f.name, tp, optional, f.default, s, cls))
    return out


def _num(x: float) -> str:
    return f"{x:g}"


def _range(s: Setting) -> str:
    if s.low is not None and s.high is not None:
        return (f"in {'(' if s.low_open else '['}{_num(s.low)}, "
                f"{_num(s.high)}{')' if s.high_open else ']'}")
    if s.low is not None:
        return f"greater than {_num(s.low)}" if s.low_open else f">= {_num(s.low)}"
    return f"less than {_num(s.high)}" if s.high_open else f"<= {_num(s.high)}"


def problem(d: Declared, value: Any) -> str | None:
    """Why ``value`` is not a value of setting ``d`` (one line, naming it), or None."""
    s, name = d.setting, d.name
    if value is None:
        return None if d.optional else f"{name} must be set"
    if d.base is int and (not isinstance(value, int) or isinstance(value, bool)):
        return f"{name} must be an integer (got {value!r})"
    if d.base is float and (not isinstance(value, int | float) or isinstance(value, bool)):
        return f"{name} must be a number (got {value!r})"
    if d.base is str and not isinstance(value, str):
        return f"{name} must be a string (got {value!r})"
    if d.base is bool and not isinstance(value, bool):
        return f"{name} must be true or false (got {value!r})"
    if s.choices and value not in s.choices:
        return f"{name} must be one of {', '.join(map(str, s.choices))} (got {value!r})"
    if s.pattern and not re.fullmatch(s.pattern, value):
        return f"{name} must be {s.pattern_help} (got {value!r})"
    if s.low is not None or s.high is not None:
        lo_bad = s.low is not None and (value <= s.low if s.low_open else value < s.low)
        hi_bad = s.high is not None and (value >= s.high if s.high_open else value > s.high)
        if lo_bad or hi_bad:
            kind = "an integer" if d.base is int else "a number"
            return f"{name} must be {kind} {_range(s)} (got {value!r})"
    return None


def check(obj: Any) -> None:
    """ValueError (the first problem) unless every declared setting of dataclass instance
    ``obj`` holds a value its declaration allows."""
    for d in declared(type(obj)):
        if (why := problem(d, getattr(obj, d.name))) is not None:
            raise ValueError(why)


def allowed(d: Declared) -> str:
    """The values a setting takes, in words ('' when its type says it all)."""
    s = d.setting
    if s.choices:
        return ", ".join(f"`{c}`" for c in s.choices)
    if s.pattern_help:
        return s.pattern_help
    if s.low is not None or s.high is not None:
        return _range(s)
    return ""
