"""A chat with tools -> prompt token ids, through the model's chat template.

A job's messages go to the engine as they are (engine.encode applies the template) unless
the job has ``tools`` or a message carries ``tool_calls``; those are rendered here, with
the tokenizer the engine loaded:

* a template that knows tools (its text mentions ``tools``, as Qwen's, Llama 3.1's,
  Mistral's and Hermes' do): ``apply_chat_template(messages, tools=...)``, the calls'
  arguments given as objects (what such templates expect), tool messages as they are;
* any other template (SmolLM2's): the documented fallback (docs/gateway.md "Tools"), plain
  messages the template can take: the tools and how to call them in a system message
  (the first one's content, before the job's own system text), each assistant message's
  calls written after its content as the JSON array a call is (wire/tools.py), and each
  run of tool results one user message ``Tool result (<name>): <content>``.

Tools are left out of the prompt under ``tool_choice: "none"`` (vLLM's default too). Pure
but for the tokenizer: the same job renders to the same ids on every worker.
"""
from __future__ import annotations

import json
from typing import Any

from pagedq.wire.schema import ChatMessage, JobRequest
from pagedq.wire.tools import NamedToolChoice, Tool, mode


def needs_rendering(req: JobRequest) -> bool:
    """Whether the job's chat is rendered here rather than by engine.encode."""
    return bool(req.tools) or any(m.tool_calls for m in req.messages or ())


def prompt_ids(tokenizer: Any, req: JobRequest) -> list[int]:
    """The prompt of a chat with tools (module doc). ValueError for a model without a
    tokenizer or a template that refuses the chat."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer: give prompts as token ids")
    tools = req.tools if req.tool_choice != "none" else None
    if "tools" in str(tokenizer.chat_template or ""):
        msgs, kw = [_native(m) for m in req.messages or ()], {}
        if tools:
            kw["tools"] = [t.model_dump(exclude_none=True) for t in tools]
    else:
        msgs, kw = fallback_messages(req.messages or [], tools, req.tool_choice), {}
    try:
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                            **kw)
    except Exception as e:  # noqa: BLE001 - a template's own refusal (jinja) fails the job
        raise ValueError(f"the model's chat template refused the messages: "
                         f"{type(e).__name__}: {e}") from None
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _native(m: ChatMessage) -> dict[str, Any]:
    d: dict[str, Any] = {"role": m.role, "content": m.text}
    if m.name is not None:
        d["name"] = m.name
    if m.tool_calls:
        d["tool_calls"] = [{"id": c.id, "type": "function",
                            "function": {"name": c.function.name,
                                         "arguments": _arguments(c.function.arguments)}}
                           for c in m.tool_calls]
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    return d


def tools_prompt(tools: list[Tool], choice: Any) -> str:
    """The fallback's system text: the tools, one JSON line each, and how to call them."""
    lines = ["You can call these tools:"]
    for t in tools:
        f = t.function
        lines.append(json.dumps({"name": f.name, "description": f.description or "",
                                 "parameters": t.parameters()}))
    how = ('a JSON array of calls, [{"name": <tool name>, "arguments": <its arguments>}], '
           "and nothing else")
    m = mode(tools, choice)
    if isinstance(choice, NamedToolChoice):
        lines.append(f"Call the tool {m}: reply with only {how}.")
    elif m == "required":
        lines.append(f"Call one or more tools: reply with only {how}.")
    else:
        lines.append(f"To call tools, reply with only {how}. Otherwise answer normally.")
    return "\n".join(lines)


def fallback_messages(messages: list[ChatMessage], tools: list[Tool] | None,
                      choice: Any) -> list[dict[str, str]]:
    """Plain {role, content} messages for a template without tools (module doc)."""
    names = {c.id: c.function.name for m in messages for c in m.tool_calls or ()}
    out: list[dict[str, str]] = []
    after_tool = False  # the last message out holds tool results
    for m in messages:
        if m.role == "tool":
            name = names.get(m.tool_call_id or "", m.name or "tool")
            line = f"Tool result ({name}): {m.text}"
            if after_tool:
                out[-1]["content"] += "\n" + line
            else:
                out.append({"role": "user", "content": line})
            after_tool = True
            continue
        after_tool = False
        content = m.text
        if m.tool_calls:
            calls = json.dumps([{"name": c.function.name,
                                 "arguments": _arguments(c.function.arguments)}
                                for c in m.tool_calls])
            content = f"{content}\n{calls}" if content else calls
        out.append({"role": m.role, "content": content})
    if tools:
        text = tools_prompt(tools, choice)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{text}\n\n{out[0]['content']}"
        else:
            out.insert(0, {"role": "system", "content": text})
    return out
