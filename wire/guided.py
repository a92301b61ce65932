"""Guided-decoding specs: what a request's output must match, and the check that a spec
compiles. Imports no torch (and no transformers): the client side and the gateway call
``validate_guided`` to refuse a bad spec at submit; its library, llguidance, is imported
only when a spec is checked or compiled, and imports no torch itself (bench/guided.py
prints both facts).

A spec is a kind and a text (``GuidedSpec``):

  json_schema  text is a JSON Schema (JSON text); the output is one JSON value valid
               against it, properties in the schema's order
  json_object  text is empty; the output is one JSON object (any keys)
  regex        text is a regular expression (Rust regex syntax) the whole output matches
  choice       text is a JSON array of strings; the output is exactly one of them
  grammar      text is a context-free grammar in Lark syntax (llguidance's dialect, start
               rule ``start``) or GBNF (root rule ``root``), converted to Lark

On the wire (a job's ``guided`` field, docs/protocol.md) a spec is an object of one key,
its kind: ``{"json_schema": {...the schema...}}``, ``{"json_object": true}``,
``{"regex": "..."}``, ``{"choice": ["a", "b"]}``, ``{"grammar": "..."}`` (``of_wire`` /
``to_wire``; OpenAI's ``response_format`` is mapped onto it, wire/schema.py).

An object schema that lists ``properties`` and says nothing of ``additionalProperties``
takes no other keys (``closed``; vLLM's default with either grammar library, and what
OpenAI's strict mode asks for): a small model given room for extra keys fills it.

JSON is written as Python's json.dumps writes it: ", " between items, ": " after keys, no
other whitespace (a small model given free whitespace may pad its output with newlines
until max_tokens); a schema may override that with llguidance's ``x-guidance`` options.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

GUIDED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# llguidance's JSON options for every schema (a schema's own "x-guidance" overrides them)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_SPEC_CHARS = 1 << 20  # a spec's text; larger ones are refused before compiling


@dataclass(frozen=True, slots=True)
class GuidedSpec:
    """What a request's output must match (module doc). Hashable: the grammar cache's key."""

    kind: str
    text: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GUIDED_KINDS:
            raise ValueError(f"guided kind must be one of {', '.join(GUIDED_KINDS)} "
                             f"(got {self.kind!r})")
        if not isinstance(self.text, str):
            raise ValueError(f"guided {self.kind}: text must be a string")
        if len(self.text) > MAX_SPEC_CHARS:
            raise ValueError(f"guided {self.kind}: text has {len(self.text)} characters; at "
                             f"most {MAX_SPEC_CHARS} are allowed")
        if self.kind == "json_object" and self.text:
            raise ValueError("guided json_object takes no text")
        if self.kind != "json_object" and not self.text:
            raise ValueError(f"guided {self.kind}: text is empty")

    @classmethod
    def of(cls, kind: str, value: Any = "") -> GuidedSpec:
        """A spec from a Python value: a schema as a dict (or JSON text), choices as a list
        of strings (or JSON text), a regex or grammar as text."""
        if kind == "json_schema" and isinstance(value, dict):
            value = json.dumps(value)
        elif kind == "choice" and isinstance(value, (list, tuple)):
            value = json.dumps(list(value))
        return cls(kind, value)


    def to_wire(self) -> dict[str, Any]:
        """The wire's one-key object (``of_wire``'s inverse)."""
        if self.kind == "json_object":
            return {"json_object": True}
        if self.kind in ("json_schema", "choice"):
            return {self.kind: json.loads(self.text)}
        return {self.kind: self.text}


def of_wire(value: Any) -> GuidedSpec:
    """The spec of a wire value (module doc): ValueError, one line, for any other shape.
    A GuidedSpec is checked the same way and comes back as the wire would carry it
    (a schema's text as json.dumps writes it). Deterministic: the same value gives the same
    spec text."""
    if isinstance(value, GuidedSpec):
        if value.kind not in ("json_schema", "choice"):
            return value
        try:
            return _of_wire(value.to_wire())
        except json.JSONDecodeError as e:
            raise ValueError(f"guided {value.kind}: text is not JSON ({e})") from None
    try:
        return _of_wire(value)
    except ValueError as e:  # the field's name comes first in a wire error: not twice
        raise ValueError(str(e).removeprefix("guided ")) from None


def _of_wire(value: Any) -> GuidedSpec:
    kinds = ", ".join(GUIDED_KINDS)
    if not (isinstance(value, dict) and len(value) == 1):
        raise ValueError(f"must be an object with one key, the kind: one of {kinds}")
    (kind, v), = value.items()
    if kind not in GUIDED_KINDS:
        raise ValueError(f"kind must be one of {kinds} (got {kind!r})")
    if kind == "json_object":
        if v is not True:
            raise ValueError("json_object must be true")
        return GuidedSpec(kind)
    want = {"json_schema": dict, "choice": list}.get(kind, str)
    if not isinstance(v, want):
        what = {dict: "a JSON Schema object", list: "a list of strings", str: "a string"}[want]
        raise ValueError(f"{kind} must be {what}")
    if kind == "choice":
        _choices(json.dumps(v))  # a list of non-empty strings
    return GuidedSpec.of(kind, v)


# the wire shape's JSON Schema (docs/schema/JobRequest.schema.json)
WIRE_JSON_SCHEMA: dict[str, Any] = {
    "description": "what the output must match: an object of one key, the kind",
    "oneOf": [
        {"type": "object", "required": ["json_schema"], "additionalProperties": False,
         "properties": {"json_schema": {"type": "object", "description": "a JSON Schema"}}},
        {"type": "object", "required": ["json_object"], "additionalProperties": False,
         "properties": {"json_object": {"const": True}}},
        {"type": "object", "required": ["regex"], "additionalProperties": False,
         "properties": {"regex": {"type": "string", "minLength": 1}}},
        {"type": "object", "required": ["choice"], "additionalProperties": False,
         "properties": {"choice": {"type": "array", "minItems": 1,
                                   "items": {"type": "string", "minLength": 1}}}},
        {"type": "object", "required": ["grammar"], "additionalProperties": False,
         "properties": {"grammar": {"type": "string", "minLength": 1,
                                    "description": "Lark (start rule start) or GBNF "
                                                   "(root rule root)"}}},
    ]}


# the keywords whose values are subschemas, one each / a list / a mapping of them
_ONE = ("items", "additionalProperties", "contains", "not", "if", "then", "else",
        "propertyNames", "unevaluatedProperties", "unevaluatedItems")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed(schema: Any) -> Any:
    """A copy of ``schema`` in which every object schema with ``properties`` and no
    ``additionalProperties`` has ``"additionalProperties": false`` (module doc)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = closed(out[key])
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [closed(s) for s in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(s) for name, s in out[key].items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def library():
    """The llguidance module (imported here, on first use); ValueError when missing."""
    try:
        import llguidance
    except ImportError:
        raise ValueError("guided decoding needs the llguidance package "
                         "(pip install 'pagedq[worker]')") from None
    return llguidance


def _choices(text: str) -> list[str]:
    try:
        items = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"guided choice: text is not a JSON array ({e})") from None
    if not (isinstance(items, list) and items
            and all(isinstance(s, str) and s for s in items)):
        raise ValueError("guided choice: text must be a JSON array of non-empty strings")
    return items


def grammar_of(spec: GuidedSpec) -> str:
    """The llguidance grammar (its JSON text) of a spec; ValueError for text that is not
    what its kind needs (not JSON, not a list of strings). Whether the grammar compiles is
    ``validate_guided``'s question (or the engine's, with the tokenizer)."""
    lib = library()
    matcher = lib.LLMatcher
    if spec.kind in ("json_schema", "json_object"):
        if spec.kind == "json_object":
            schema: Any = {"type": "object"}
        else:
            try:
                schema = json.loads(spec.text)
            except json.JSONDecodeError as e:
                raise ValueError(f"guided json_schema: text is not JSON ({e})") from None
            if not isinstance(schema, dict):
                raise ValueError("guided json_schema: a schema is a JSON object")
        return matcher.grammar_from_json_schema(closed(schema), defaults=JSON_OPTIONS)
    if spec.kind == "regex":
        return matcher.grammar_from_regex(spec.text)
    if spec.kind == "choice":
        lark = "start: " + " | ".join(json.dumps(s) for s in _choices(spec.text))
        return matcher.grammar_from_lark(lark)
    try:
        return lib.grammar_from("grammar", spec.text)  # Lark, or GBNF converted to Lark
    except ValueError as e:
        raise ValueError(f"guided grammar: {one_line(str(e))}") from None


def one_line(message: str) -> str:
    """A library error on one line: its first line, and its ``error:`` line if any (regex
    and Lark errors draw the spot on the lines between)."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if not lines:
        return "invalid"
    detail = next((line[6:].strip() for line in lines[1:] if line.startswith("error:")), "")
    return f"{lines[0]} {detail}".strip()


def validate_guided(spec: GuidedSpec) -> None:
    """Raise ValueError (one line: the kind, what is wrong) unless ``spec`` compiles. No
    tokenizer is needed, nor torch: about a millisecond for a schema (bench/guided.py). The
    engine compiles it again against its vocabulary at add_request."""
    error = library().LLMatcher.validate_grammar(grammar_of(spec))
    if error:
        raise ValueError(f"guided {spec.kind}: {one_line(error)}")


_CHECKED: OrderedDict[GuidedSpec, None] = OrderedDict()  # specs that compiled, most recent last
_CHECKED_LOCK = threading.Lock()
CHECKED_MAX, CHECKED_MAX_CHARS = 256, 1 << 16  # kept: at most this many, this small


def check_compiles(spec: GuidedSpec) -> None:
    """``validate_guided``, remembered for the small specs that compiled (a client submits
    the same schema again and again: ~1 ms each, bench/guided.py)."""
    with _CHECKED_LOCK:
        if spec in _CHECKED:
            _CHECKED.move_to_end(spec)
            return
    validate_guided(spec)
    if len(spec.text) <= CHECKED_MAX_CHARS:
        with _CHECKED_LOCK:
            _CHECKED[spec] = None
            while len(_CHECKED) > CHECKED_MAX:
                _CHECKED.popitem(last=False)
