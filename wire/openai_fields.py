"""Every field of OpenAI's chat and completions request bodies, sorted by what pagedq does
with it (docs/gateway.md's compatibility table is this module in words). Pure.

* served: mapped onto ``JobRequest`` (wire/schema.py: ``max_completion_tokens``,
  ``top_logprobs``, ``user``, ``stop: null``, ``response_format`` and the sampling fields)
  or by the endpoint (``prompt`` lists, ``echo``, ``stream``, ``stream_options``:
  wire/openai_api.py and the gateway);
* ``IGNORED``: accepted and dropped. None of them can change the output: storage, caching
  and billing hints (``store``, ``service_tier``, ``prompt_cache_*``, ``safety_identifier``)
  and controls the models pagedq serves do not have (``reasoning_effort``, ``verbosity``:
  no reasoning model, as vLLM ignores them for such models); ``modalities: ["text"]``;
* refused (``FieldError``, a 400 naming the field): fields that would change the output and
  are not served (audio output, ``prediction``, web search, ``moderation``, the legacy
  ``functions``, ``best_of`` above ``n``, a ``suffix``).

Invariant: ``check`` is deterministic in its input (the batch ingest re-parses a line after
a crash and must get the same request).
"""
from __future__ import annotations

from typing import Any

CHAT, COMPLETION = "chat", "completion"
IGNORED = ("store", "service_tier", "prompt_cache_key", "prompt_cache_options",
           "prompt_cache_retention", "safety_identifier", "reasoning_effort", "verbosity")
# field -> why it is refused (when set to anything but null)
REFUSED = {
    "audio": "audio output is not served (pagedq generates text)",
    "prediction": "predicted outputs are not served",
    "web_search_options": "web search is not served",
    "functions": "the legacy functions are not served: send tools",
    "function_call": "the legacy function_call is not served: send tool_choice",
    "moderation": "moderation is not served",
}


class FieldError(ValueError):
    """A field pagedq does not serve; ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def check(kind: str, data: dict[str, Any]) -> None:
    """Drop ``data``'s ignored fields (in place); FieldError for one that is refused."""
    for name in IGNORED:
        data.pop(name, None)
    for name, why in REFUSED.items():
        if data.get(name) is not None:
            raise FieldError(name, why)
        data.pop(name, None)
    modalities = data.pop("modalities", None)
    if modalities is not None and modalities != ["text"]:
        raise FieldError("modalities", "only [\"text\"] is served")
    if kind == COMPLETION:
        best_of = data.pop("best_of", None)
        if best_of is not None and best_of != data.get("n", 1):
            raise FieldError("best_of", "only best_of equal to n (every sample returned) is "
                             "served")
        if data.pop("suffix", None) not in (None, ""):
            raise FieldError("suffix", "a suffix (insertion) is not served")


def response_format(rf: Any) -> dict[str, Any] | None:
    """OpenAI's response_format (or the Responses API's ``text.format``, flattened to the
    same shape) -> the wire's guided spec (None for plain text)."""
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text" and set(rf) == {"type"}:
        return None
    if kind == "json_object" and set(rf) == {"type"}:
        return {"json_object": True}
    if kind == "json_schema" and set(rf) == {"type", "json_schema"}:
        js = rf["json_schema"]
        if not (isinstance(js, dict) and set(js) <= {"name", "schema", "strict", "description"}
                and isinstance(js.get("schema"), dict)):
            raise ValueError("response_format.json_schema must be {\"name\", \"schema\": "
                             "{...}, \"strict\"?, \"description\"?}")
        return {"json_schema": js["schema"]}
    raise ValueError("response_format must be {\"type\": \"text\"}, {\"type\": "
                     "\"json_object\"} or {\"type\": \"json_schema\", \"json_schema\": "
                     "{\"name\", \"schema\"}}")
