"""A job's event log -> Server-Sent Events in OpenAI's chunk format, each with an id.

Every SSE event carries ``id: <job id>/<k>.<j>``: chunk ``j`` of the rendering of the
job's event ``k`` (docs/protocol.md: event k is out-stream entry ``0-(k+1)``). ``/`` is
not in a job id's alphabet, so the id splits unambiguously. Rendering is deterministic:
event k gives the same chunks, in the same order, on every connection:

* event 0 of a chat job starts with one chunk naming the assistant (``role``) for each
  choice;
* a token event: one chunk with its choice's text delta (and its logprobs when asked),
  or, for a chat choice whose tools are active and whose output is calls, its tool-call
  deltas (wire/openai_api.py ``CallStream``: an empty delta until a call's name is out);
* the final event: one chunk with every choice's ``finish_reason`` (status finished or
  cancelled; ``tool_calls`` for complete calls) or one ``{"error": ...}`` event (failed,
  expired), then the usage chunk (``stream_options.include_usage``), then ``data: [DONE]``;
* ``continuous_usage_stats``: every chunk's ``usage`` holds the running totals (the
  prompt's tokens from event 0's ``pt``, the completion's counted by ``ids``);
* ``echo`` (completions): a choice's first token chunk starts with the prompt, and its
  logprobs with the prompt's entries (event 0's ``plp``).

A client that reconnects with ``Last-Event-ID: <job>/<k>.<j>`` gets the job's events from
k on (AsyncClient.stream from index k), minus event k's chunks up to j: no gap, no repeat.
The state carried across events (a completion's logprob ``text_offset``, a choice's calls
read so far, the usage counted, the prompt to echo) is rebuilt by rendering the log before
k (``prime``).
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from pagedq.producer.aio import AsyncClient
from pagedq.wire.openai_api import (
    CHAT,
    CallStream,
    Echo,
    chat_logprobs,
    chunk,
    chunk_choice,
    completion_logprobs,
    finish_reason_of,
    usage,
)
from pagedq.wire.schema import Event, FinalEvent, FinishReason, Status, TokenEvent, parse_event

DONE = "[DONE]"


def event_id(job_id: str, k: int, j: int) -> str:
    return f"{job_id}/{k}.{j}"


def frame(eid: str, data: dict[str, Any] | str) -> bytes:
    """One SSE event (``data`` is one line: JSON never holds a raw newline)."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"id: {eid}\ndata: {payload}\n\n".encode()


class Counter:
    """The tokens a response's stream has seen so far (shared by its jobs' renderers): the
    usage of ``stream_options.include_usage`` and of every chunk under
    ``continuous_usage_stats``."""

    __slots__ = ("prompt", "completion")

    def __init__(self) -> None:
        self.prompt = self.completion = 0

    def body(self) -> dict[str, int]:
        return usage(self.prompt, self.completion)


class Renderer:
    """Chunks of one job's events; ``offsets``: per choice, the completion text offset of
    the next token (logprobs of completions only); ``calls``: per choice, its tool calls
    read so far (a chat whose tools are active, else None).

    A job of a request of several prompts (completions) renders its choices at ``base`` +
    choice under the response's ``name`` (its first job's id), and its final event without
    the usage chunk and ``[DONE]`` (``tail``: the stream of all its jobs adds them once)."""

    def __init__(self, kind: str, job_id: str, model: str, created: int, n: int,
                 include_usage: bool, logprobs: bool, tools: bool = False, *,
                 continuous: bool = False, echo: bool = False, prompt: str | None = None,
                 base: int = 0, name: str | None = None, tail: bool = True,
                 counter: Counter | None = None) -> None:
        self.kind, self.job_id, self.model, self.created = kind, job_id, model, created
        self.n, self.include_usage, self.logprobs = n, include_usage, logprobs
        self.offsets = [0] * n
        self.tools = tools and kind == CHAT
        self.calls = [CallStream(job_id, c) for c in range(n)] if self.tools else None
        self.continuous, self.echo, self.prompt = continuous, echo and kind != CHAT, prompt
        self.base, self.name, self.tail = base, name or job_id, tail
        self.counter = counter or Counter()
        self.seen = [0, 0]  # this job's prompt and completion tokens counted so far
        self.plp: list[dict[str, Any]] | None = None  # its prompt's entries (event 0)
        self.echoed: set[int] = set()  # choices whose prompt was repeated already

    @property
    def stateful(self) -> bool:
        """Whether rendering an event depends on the events before it."""
        return (self.calls is not None or (self.logprobs and self.kind != CHAT) or self.echo
                or self.continuous)

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return chunk(self.kind, self.name, self.model, self.created, choices,
                     self.include_usage, self.counter.body() if self.continuous else None)

    def _count(self, prompt: int, completion: int) -> None:
        self.seen[0] += prompt
        self.seen[1] += completion
        self.counter.prompt += prompt
        self.counter.completion += completion

    def render(self, ev: Event) -> list[dict[str, Any] | str]:
        """Event ``ev``'s chunks, in order (their index is the ``j`` of their ids)."""
        out: list[dict[str, Any] | str] = []
        if isinstance(ev, TokenEvent):
            self._count(ev.prompt_tokens or 0, len(ev.token_ids))
            if ev.prompt_logprobs is not None:
                self.plp = [e.model_dump() for e in ev.prompt_logprobs]
        else:  # the final event's counts are the job's
            self._count(ev.usage.prompt_tokens - self.seen[0],
                        ev.usage.completion_tokens - self.seen[1])
        if ev.index == 0 and self.kind == CHAT:
            out.append(self._chunk([chunk_choice(CHAT, self.base + c, role=True)
                                    for c in range(self.n)]))
        if isinstance(ev, TokenEvent):
            out.append(self._chunk([self._token(ev)]))
            return out
        assert isinstance(ev, FinalEvent)
        if ev.status in (Status.finished, Status.cancelled):
            ends = {c.index: (c.text, c.finish_reason) for c in ev.choices or []}
            ends.setdefault(0, (ev.text, ev.finish_reason))
            out.append(self._chunk([chunk_choice(
                self.kind, self.base + c, finish_reason=finish_reason_of(
                    *ends.get(c, ("", ev.finish_reason)), self.tools) or ev.finish_reason)
                for c in range(self.n)]))
        else:
            out.append(final_error(ev))
        if self.tail:
            out += self.end()
        return out

    def end(self) -> list[dict[str, Any] | str]:
        """What closes the response's stream: the usage chunk when asked for, [DONE]."""
        if not self.include_usage:
            return [DONE]
        c = chunk(self.kind, self.name, self.model, self.created, [], True, self.counter.body())
        return [c, DONE]

    def _token(self, ev: TokenEvent) -> dict[str, Any]:
        c, text = ev.choice, ev.delta
        entries = [t.model_dump() for t in ev.logprobs] if ev.logprobs is not None else None
        if self.echo and c not in self.echoed:  # its first event repeats the prompt
            self.echoed.add(c)
            echo = Echo.of(self.prompt, self.plp, self.logprobs)
            text = echo.text + text
            if echo.entries is not None:
                entries = echo.entries + (entries or [])
        lp = None
        if self.logprobs and entries is not None:
            if self.kind == CHAT:
                lp = chat_logprobs(entries)
            else:
                lp = completion_logprobs(entries, self.offsets[c])
                self.offsets[c] += sum(len(t["token"]) for t in entries)
        calls = self.calls[c].feed(ev.delta) if self.calls is not None else None
        return chunk_choice(self.kind, self.base + c, text, logprobs=lp, tool_calls=calls)


def final_error(ev: FinalEvent) -> dict[str, Any]:
    """The error a failed or expired job ends its stream with (OpenAI's SDKs raise it)."""
    if ev.status == Status.expired and ev.finish_reason == FinishReason.no_worker:
        code, msg = "no_worker", "no worker served the model; the job expired"
    elif ev.status == Status.expired:
        code, msg = "deadline", "the job's timeout_s ran out before it started"
    else:
        code, msg = "job_failed", ev.error or "the job failed"
    return {"error": {"message": msg, "type": "server_error", "param": None, "code": code}}


async def prime(client: AsyncClient, r: Renderer, k: int) -> None:
    """Render (and drop) the job's events before event k: a resumed stream's renderer
    then carries the state an uninterrupted one would have at k."""
    if k <= 0 or not r.stateful:
        return
    for _, f in await client.redis.xrange(client.keys_of(r.job_id).out(r.job_id), "0-1",
                                          f"0-{k}"):
        r.render(parse_event(f))


async def sse(client: AsyncClient, r: Renderer, start: int = 0, skip_through: int = -1,
              created: Awaitable[int] | None = None
              ) -> AsyncIterator[tuple[bytes, FinalEvent | None]]:
    """(SSE bytes, the final event once it is reached) for the job's events from
    ``start``; the chunks of event ``start`` up to ``skip_through`` are left out (a
    resumed stream). ``created``: the chunks' ``created``, awaited before the first
    (it is read while the stream waits for that event)."""
    async for ev in client.stream(r.job_id, from_index=start):
        if created is not None:
            r.created, created = await created, None
        chunks = r.render(ev)
        final = ev if isinstance(ev, FinalEvent) else None
        yield b"".join(frame(event_id(r.job_id, ev.index, j), c) for j, c in enumerate(chunks)
                       if not (ev.index == start and j <= skip_through)), final
        if final is not None:
            return
