"""How a job samples, declared once: ``SamplingParams``, the engine's per-request parameters
(a dataclass: the engine re-exports it from engine/sampling_params.py), whose fields with
their types, defaults and ranges are also the wire's (``with_sampling``: the pydantic
fields ``JobRequest`` is built on, wire/schema.py). A producer and the engine therefore accept the
same values; the worker passes a request's fields to the engine by name
(worker/jobs.py), and the clients' submit() takes one keyword per field (checked by
tests/test_pagedq_package.py). pydantic and the standard library only: the engine
imports this, and it never imports redis.

A new sampling field is one field of SamplingParams (and the code that uses it, and its
keyword in both clients' submit(), its row in docs/protocol.md, the JSON Schemas:
``python -m pagedq.wire.jsonschema``); ``metadata={"wire": False}`` keeps an engine-only
one off the wire. A field whose wire shape is not its Python type says how to convert
both ways in its annotation (``guided``: a one-key object, ``logit_bias``: token ids as
strings, as JSON keys are).
"""
from __future__ import annotations

import copy
import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)
from pydantic.functional_serializers import PlainSerializer
from pydantic.json_schema import WithJsonSchema

from pagedq.wire.guided import WIRE_JSON_SCHEMA, GuidedSpec, of_wire

MAX_TOKENS_LIMIT = 32768
MAX_STOP_STRINGS = 16
MAX_N = 16
LOGIT_BIAS_LIMIT = 100.0  # |bias| at most this (OpenAI's range)
MAX_LOGIT_BIAS = 300  # entries of one request's logit_bias (OpenAI's limit)


def sample_seed(seed: int, k: int) -> int:
    """The seed of sample k of a request seeded with ``seed`` (its n samples, or a job's
    choices): one rule for the offline engine and the worker, so that the same request gives
    the same samples both ways, and every sample's seed stays in [0, 2**63)."""
    return (seed + k) % 2**63


def sample_id(request_id: str, k: int, n: int) -> str:
    """The engine request id of sample k of a request of n samples ("id#k"; the id itself
    when n == 1). Request ids never contain '#' (job ids and key prefixes do not)."""
    return request_id if n == 1 else f"{request_id}#{k}"


def split_sample_id(rid: str) -> tuple[str, int]:
    """``sample_id``'s inverse: (request id, k)."""
    base, sep, k = rid.partition("#")
    return base, int(k) if sep else 0


def fan_out(request_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """A request of ``params.n`` samples as that many engine requests of one sample each:
    their ids (``sample_id``) and parameters (n = 1, sample k seeded ``sample_seed(seed,
    k)``). The one place a request becomes its samples: the engine's add_request (so the
    offline API) and the worker's choices both go through it."""
    n = params.n
    if n == 1:
        return [(request_id, params)]
    out = []
    for k in range(n):
        p = copy.copy(params)  # valid already: n = 1 and sample_seed stay in range
        object.__setattr__(p, "n", 1)
        if p.seed is not None:
            object.__setattr__(p, "seed", sample_seed(p.seed, k))
        out.append((sample_id(request_id, k, n), p))
    return out


def describe(e: ValidationError, limit: int = 8) -> str:
    """A validation error as one line: ``field: problem; field: problem``."""
    parts = []
    for err in e.errors()[:limit]:
        # drop pydantic's internal union/validator tags such as "function-after[...]"
        loc = ".".join(str(x) for x in err["loc"] if "[" not in str(x))
        msg = err["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def _unicode(s: str) -> str:
    """Lone surrogates (from "\\ud800" JSON escapes, or undecodable bytes) cannot be encoded
    as UTF-8: neither Redis, the tokenizer nor another client could take them."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text is not valid Unicode (it holds a lone surrogate)") from None
    return s


Text = Annotated[str, AfterValidator(_unicode)]

# a guided spec on the wire: {"json_schema": {...}} and the like (wire/guided.py)
Guided = Annotated[GuidedSpec, BeforeValidator(of_wire),
                   PlainSerializer(GuidedSpec.to_wire, return_type=dict),
                   WithJsonSchema(WIRE_JSON_SCHEMA)]


def _token_ids(v: Any) -> Any:
    """logit_bias keys: token ids, as JSON (and OpenAI) writes them, strings of digits."""
    if isinstance(v, dict):
        return {int(k) if isinstance(k, str) and k.isascii() and k.isdigit() else k: b
                for k, b in v.items()}
    return v


LOGIT_BIAS_SCHEMA = {
    "type": "object", "maxProperties": MAX_LOGIT_BIAS,
    "description": "token id (a string of digits) -> bias added to its logit",
    "propertyNames": {"pattern": "^[0-9]+$"},
    "additionalProperties": {"type": "number", "minimum": -LOGIT_BIAS_LIMIT,
                             "maximum": LOGIT_BIAS_LIMIT}}


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling parameters, validated on construction (ValueError, one line)."""

    # 0: no token, the prompt only scored (needs prompt_logprobs: OpenAI's echo with
    # max_tokens 0)
    max_tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS_LIMIT)] = 128
    temperature: Annotated[float, Field(ge=0.0, le=100.0)] = 1.0  # 0 = greedy
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = -1  # -1 or 0 = off
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] = 1.0
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    stop: Annotated[list[Annotated[Text, Field(min_length=1, max_length=256)]],
                    Field(max_length=MAX_STOP_STRINGS)] = field(default_factory=list)
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]],
                              Field(max_length=64)] = field(default_factory=list)
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None  # top alternatives per token
    # each prompt token's log-probability given the tokens before it (the first has none),
    # with this many top alternatives: computed during the prefill
    # (engine/prompt_logprobs.py), on the wire in the job's event 0
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    # guided decoding: the output must match this spec (wire/guided.py); it is compiled at
    # add_request (a spec that cannot compile is a ValueError there)
    guided: Guided | None = None
    # token id -> added to its logit before sampling (after penalties, before the
    # min_tokens and guided masks); ids are checked against the vocabulary at add_request.
    # None = no bias (kept off the stored body, whose bytes are its idempotency key)
    logit_bias: Annotated[
        dict[Annotated[int, Field(ge=0)],
             Annotated[float, Field(ge=-LOGIT_BIAS_LIMIT, le=LOGIT_BIAS_LIMIT,
                                    allow_inf_nan=False)]],
        Field(max_length=MAX_LOGIT_BIAS), BeforeValidator(_token_ids),
        WithJsonSchema(LOGIT_BIAS_SCHEMA)] | None = None

    def __post_init__(self) -> None:
        try:
            checked = _Checked.model_validate({f: getattr(self, f) for f in _ALL})
        except ValidationError as e:
            raise ValueError(describe(e)) from None
        for name in _ALL:  # as validated: a str stop is a list of one
            setattr(self, name, getattr(checked, name))

    @classmethod
    def of_request(cls, req: Any, **changes: Any) -> SamplingParams:
        """The sampling fields of a request the wire's model validated (``with_sampling``:
        the same declarations), not validated again: the worker's path, one per choice.
        ``changes`` must keep them valid (the worker's n=1 and ``sample_seed``); an
        engine-only field takes its default."""
        sp = object.__new__(cls)
        for name, wire, default in _MAKE:
            if name in changes:
                value = changes[name]
            else:
                value = getattr(req, name) if wire else default()
            object.__setattr__(sp, name, value)
        return sp

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class _Rules(BaseModel):
    """What holds between the sampling fields, and the shapes they are given in."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @field_validator("stop", mode="before", check_fields=False)
    @classmethod
    def _stop_as_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @model_validator(mode="after")
    def _min_tokens(self) -> Any:
        if self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must not exceed max_tokens")
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise ValueError("max_tokens: 0 generates nothing; it only scores the prompt "
                             "(with prompt_logprobs, or echo and logprobs on /v1/completions)")
        return self


def _model(name: str, names: tuple[str, ...], base: type[BaseModel] | None = None,
           ) -> type[BaseModel]:
    hints = typing.get_type_hints(SamplingParams, include_extras=True)
    fields = {f.name: f for f in dataclasses.fields(SamplingParams)}

    def default(f: dataclasses.Field) -> Any:
        if f.default_factory is not dataclasses.MISSING:
            return Field(default_factory=f.default_factory)
        return f.default

    return create_model(name, __base__=(base, _Rules) if base else _Rules,
                        **{n: (hints[n], default(fields[n])) for n in names})


_ALL = tuple(f.name for f in dataclasses.fields(SamplingParams))
# (name, on the wire, its default) of each field, for of_request
_MAKE = tuple((f.name, f.metadata.get("wire", True),
               f.default_factory if f.default_factory is not dataclasses.MISSING
               else (lambda d=f.default: d))
              for f in dataclasses.fields(SamplingParams))
_Checked = _model("SamplingParams", _ALL)
# the fields on the wire, in SamplingParams' order
WIRE_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams)
                    if f.metadata.get("wire", True))


def with_sampling(base: type[BaseModel]) -> type[BaseModel]:
    """``base`` followed by the wire's sampling fields (JobRequest's fields: its head,
    these, then its own: wire/schema.py). One class, so a request's JSON keeps its order."""
    return _model(base.__name__.lstrip("_") + "Sampling", WIRE_FIELDS, base)
