"""Tool calling on the wire: OpenAI's ``tools`` / ``tool_choice`` / ``parallel_tool_calls``
and the tool calls of chat messages (their pydantic shapes), the grammar a job's output
follows when it may call a tool, and reading the calls back out of its text. Pure: no
torch, no Redis; the worker (worker/chat.py renders the prompt), the clients (the compile
check at submit) and the gateway and batch files (the response's ``tool_calls``) share it.

The output of a job whose tools are active (``tools`` given, ``tool_choice`` not
``"none"``) is either text or ONE format of tool calls, whatever the model: a JSON array
of ``{"name": <a tool's name>, "arguments": <an object valid against its parameters>}``,
written as wire/guided.py writes JSON (", " and ": ", nothing else between tokens):

  tool_choice "required"           the output is an array of calls (one or more; exactly
                                   one when parallel_tool_calls is false)
  {"type": "function", ...name}    the output is an array of one call of that function
  "auto" (the default with tools)  an array of calls, or text that does not start with
                                   "[" (or, with a json_schema / json_object ``guided``
                                   spec, that JSON value: it starts with "{")

so an output is a call exactly when its first character is "[" (``calls_of``). A model
whose chat template knows tools was taught its own format; under "auto" it may answer a
call in that format as text (docs/gateway.md "Tools").
"""
from __future__ import annotations

import hashlib
import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedq.wire.guided import JSON_OPTIONS, GuidedSpec, check_compiles, closed

MAX_TOOLS = 128  # OpenAI's limit
NAME = Annotated[str, Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")]
CALL_JSON_KINDS = ("json_schema", "json_object")  # guided kinds "auto" combines with


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionDef(_Strict):
    name: NAME
    description: Annotated[str, Field(max_length=8192)] | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of an object; none = {}
    strict: bool | None = None  # accepted; the grammar always holds the output to it


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef

    def parameters(self) -> dict[str, Any]:
        return self.function.parameters or {"type": "object", "properties": {}}


class CalledFunction(_Strict):
    name: NAME
    arguments: Annotated[str, Field(max_length=1_000_000)]  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    """A call of an assistant message (``messages[i].tool_calls``)."""

    id: Annotated[str, Field(min_length=1, max_length=256)]
    type: Literal["function"] = "function"
    function: CalledFunction


class NamedFunction(_Strict):
    name: NAME


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def mode(tools: list[Tool] | None, choice: ToolChoice | None) -> str | None:
    """None (no tools, or ``"none"``), ``"auto"``, ``"required"`` or the named function's
    name: what the output may be."""
    if not tools or choice == "none":
        return None
    if isinstance(choice, NamedToolChoice):
        return choice.function.name
    return choice or "auto"


def problem(tools: list[Tool] | None, choice: ToolChoice | None,
            guided: GuidedSpec | None, chat: bool) -> str | None:
    """What is wrong between a request's tool fields (None: nothing). JobRequest's check."""
    if not tools:
        if choice not in (None, "none"):
            return "tool_choice needs tools"
        return None
    if not chat:
        return "tools need messages (a chat), not a prompt"
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        return "tools: two functions have the same name"
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        return f"tool_choice names the function {choice.function.name!r}, which is not in tools"
    if mode(tools, choice) == "auto" and guided is not None and guided.kind not in CALL_JSON_KINDS:
        return (f"guided {guided.kind} cannot be combined with tool_choice auto (only "
                "json_schema and json_object can: the answer is then that JSON or a call)")
    return None


def _call_schema(tool: Tool) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
            "properties": {"name": {"const": tool.function.name},
                           "arguments": closed(tool.parameters())}}


def calls_schema(tools: list[Tool], only: str | None = None,
                 one: bool = False) -> dict[str, Any]:
    """The JSON Schema of an output of calls (module doc): of the function ``only`` (then
    one call), or of any of ``tools``; ``one``: exactly one call."""
    chosen = [t for t in tools if only is None or t.function.name == only]
    items = _call_schema(chosen[0]) if len(chosen) == 1 else {
        "anyOf": [_call_schema(t) for t in chosen]}
    schema: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
    if one or only is not None:
        schema["maxItems"] = 1
    return schema


def output_spec(guided: GuidedSpec | None, tools: list[Tool] | None,
                choice: ToolChoice | None, parallel: bool | None) -> GuidedSpec | None:
    """The spec a job's output follows: its ``guided`` one, or its tools' (module doc).
    Deterministic (the worker derives it again from the same body)."""
    m = mode(tools, choice)
    if m is None:
        return guided
    assert tools  # mode() said so
    one = parallel is False
    if m != "auto":
        return GuidedSpec.of("json_schema", calls_schema(tools, None if m == "required" else m,
                                                         one))
    calls = {**calls_schema(tools, None, one), "x-guidance": JSON_OPTIONS}
    rules = ["start: calls | answer", "calls: %json " + json.dumps(calls)]
    if guided is None:
        rules += ["answer: TEXT?", r"TEXT: /[^\[][\s\S]*/"]
    else:  # json_schema or json_object (problem() refuses the others)
        schema = (closed(json.loads(guided.text)) if guided.kind == "json_schema"
                  else {"type": "object"})
        rules.append("answer: %json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS}))
    return GuidedSpec("grammar", "\n".join(rules))


def check_output(guided: GuidedSpec | None, tools: list[Tool] | None,
                 choice: ToolChoice | None, parallel: bool | None) -> None:
    """ValueError (one line) unless the job's output spec compiles (the clients' check at
    submit; the worker's engine compiles it again, and fails the job if it cannot). A
    tool's parameters are checked on their own first, so that the error names the tool."""
    if mode(tools, choice) is not None:
        for k, tool in enumerate(tools or ()):
            try:
                check_compiles(GuidedSpec.of("json_schema", tool.parameters()))
            except ValueError as e:
                detail = str(e).removeprefix("guided json_schema: ")
                raise ValueError(f"tools.{k}.function.parameters ({tool.function.name}): "
                                 f"{detail}") from None
    spec = output_spec(guided, tools, choice, parallel)
    if spec is not None:
        check_compiles(spec)


def call_id(job_id: str, choice: int, k: int) -> str:
    """Call ``k`` of choice ``choice`` of a job: deterministic (a resumed stream and a
    batch re-collected name it the same), short and alphanumeric (some chat templates
    limit a call id's length)."""
    return "call_" + hashlib.sha256(f"{job_id}/{choice}/{k}".encode()).hexdigest()[:24]


_HEAD = re.compile(r'(?:\[|, )\{"name": "([A-Za-z0-9_\-]{1,64})", "arguments": ')


class CallScanner:
    """Reads calls out of an output's text as it grows (``feed``): each call's name once
    its head is complete, then its arguments' text as it arrives. The text is the
    grammar's (module doc), so a call's arguments end at the first ``}`` outside a string
    that closes nothing they opened."""

    __slots__ = ("buf", "pos", "calls", "_depth", "_in_str", "_esc", "_in_args")

    def __init__(self) -> None:
        self.buf, self.pos = "", 0
        self.calls: list[list[str]] = []  # [name, arguments so far]
        self._depth, self._in_str, self._esc, self._in_args = 0, False, False, False

    def feed(self, delta: str) -> list[tuple[int, bool, str]]:
        """(call index, whether the call is new, arguments text) pieces of ``delta``."""
        self.buf += delta
        out: dict[int, list[Any]] = {}
        while self.pos < len(self.buf):
            if not self._in_args:
                m = _HEAD.match(self.buf, self.pos)
                if m is None:
                    break  # the head is not complete yet (or the text is no call)
                self.calls.append([m[1], ""])
                self.pos, self._in_args = m.end(), True
                out[len(self.calls) - 1] = [True, ""]
                continue
            start = self.pos
            while self.pos < len(self.buf) and self._in_args:
                self._step(self.buf[self.pos])
                self.pos += 1
            end = self.pos if self._in_args else self.pos - 1  # not the call's own "}"
            k = len(self.calls) - 1
            self.calls[k][1] += self.buf[start:end]
            out.setdefault(k, [False, ""])[1] += self.buf[start:end]
        return [(k, new, text) for k, (new, text) in out.items()]

    def _step(self, ch: str) -> None:
        if self._in_str:
            if self._esc:
                self._esc = False
            elif ch == "\\":
                self._esc = True
            elif ch == '"':
                self._in_str = False
        elif ch == '"':
            self._in_str = True
        elif ch in "{[":
            self._depth += 1
        elif ch in "}]":
            if self._depth == 0:  # the call's own "}"
                self._in_args = False
            else:
                self._depth -= 1


def calls_of(text: str) -> list[tuple[str, str]] | None:
    """The (name, arguments JSON text) calls of a whole output, or None when it is not a
    complete array of calls (text, or cut short by max_tokens). The arguments are the
    output's own text of them (what a stream of it sent)."""
    if not text.startswith("["):
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not (isinstance(value, list) and value and all(
            isinstance(c, dict) and set(c) == {"name", "arguments"} for c in value)):
        return None
    scanner = CallScanner()
    scanner.feed(text)
    calls = [(name, args) for name, args in scanner.calls]
    if [n for n, _ in calls] != [c["name"] for c in value]:
        return None
    return calls
