"""Synchronous producer client: submit, status, stream, result, cancel.

The reading protocol (status, result, stream, subscribe: cursor, trimmed log, terminal
re-read, timeouts) lives in producer/reader.py, sans I/O, shared with the asyncio client
(producer/aio.py); request building in producer/requests.py, the scripts' calls in
wire/scripts.py. This class is
the I/O shell: it makes the Redis calls those ask for and hands back the replies.

Riding out a Redis restart: every Redis call of both clients goes through a retry loop
(``Client._retry`` / ``AsyncClient._retry``) with one shared policy, ``Backoff``: a
connection-level failure is retried whole, with capped exponential backoff, for up to
``settings.client_retry_s`` seconds from its first failure, then re-raised (wrong
credentials and TLS certificate errors are not retried: ``RedisUnusable`` at once, see
wire/connection.py). Each call is safe to repeat: SUBMIT is idempotent by job id and
request hash ('exists'), CANCEL is idempotent, the rest are reads; a cut XREAD is re-sent
from the same cursor, so stream() neither loses nor repeats an event. The pools are built
without redis-py's retry options, so their connections do not retry on their own
(``Retry(NoBackoff(), 0)``): this is the only retry policy, but on a Redis Cluster, where
redis-py's cluster client first retries a few times itself, reloading the slot map (a
master failing over).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, Unpack

import redis

from pagedq.wire import script, scripts
from pagedq.wire.connection import client_redis, diagnose_tls
from pagedq.wire.keys import Keys
from pagedq.wire.redis_errors import RETRYABLE, RedisUnusable, is_fatal, looks_cut_by_tls
from pagedq.wire.schema import Event, JobRecord, JobRequest
from pagedq.wire.settings import Settings

from . import reader, requests, submit_params
from .reader import RETRY_CAP_S, RETRY_FIRST_S, Backoff
from .submit_params import SubmitOptions

# the retry policy is re-exported from here, where it was first defined
__all__ = ["RETRYABLE", "RETRY_CAP_S", "RETRY_FIRST_S", "Backoff", "Client"]

T = TypeVar("T")


# ---------------------------------------------------------------- the client

class Client:
    """``Client(redis_url=None, *, prefix=None, model=None, settings=None)``; unset
    arguments come from ``Settings()`` (PAGEDQ_* environment). Thread-safe."""

    def __init__(self, redis_url: str | None = None, *, prefix: str | None = None,
                 model: str | None = None, settings: Settings | None = None) -> None:
        self.settings, self.keys, self.model, pool = reader.client_setup(
            redis_url, prefix, model, settings)
        self._url = pool["url"]
        self.redis: redis.Redis = client_redis(self.settings, pool)

    def keys_of(self, job_id: str) -> Keys:
        """The keys of the partition holding ``job_id`` (``self.keys``: partition 0)."""
        return self.keys.of_job(requests.checked_id(job_id), self.settings.partitions)

    def _retry(self, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``call(*args, **kwargs)``, repeated on connection-level failures (see Backoff);
        refused credentials or TLS set-up raise RedisUnusable at once."""
        backoff, diagnosed = Backoff(self.settings.client_retry_s), False
        while True:
            try:
                return call(*args, **kwargs)
            except RETRYABLE as e:
                if is_fatal(e):
                    raise RedisUnusable(self._url, e) from e
                if not diagnosed and looks_cut_by_tls(self._url, e):  # once per call
                    diagnosed = True
                    if (bad := diagnose_tls(self.settings, self._url)) is not None:
                        raise bad from e
                time.sleep(backoff.delay_after(e))

    def _drive(self, proto: reader.Protocol, ps: Any = None) -> Iterator[Any]:
        """Runs a reading protocol of producer/reader.py: makes each Redis command it asks
        for (through _retry, on ``ps`` for pub/sub ones) and sends back the reply; yields
        its events; returns what it returns."""
        run = reader.Exchange(proto)
        for step in run:
            if isinstance(step, reader.Command):
                run.reply = self._retry(step.call, self.redis, ps)
            else:
                yield step
        return run.value

    def _call(self, proto: reader.Protocol) -> Any:
        """A protocol without events (status, result): run it, return its value."""
        run = reader.Exchange(proto)
        for cmd in run:
            run.reply = self._retry(cmd.call, self.redis)
        return run.value

    # -- submit
    def submit(self, prompt: str | list[int] | None = None,
               **options: Unpack[SubmitOptions]) -> str:
        """Validate and enqueue one generation job; returns its id. Idempotent per job id
        (the same id and body again returns the id; another body raises JobConflict).
        Raises InvalidRequest (nothing enqueued), Overloaded, NoWorker, JobConflict.

        Exactly one of ``prompt`` and ``messages``; every other parameter left at None
        takes the wire default, in brackets (docs/protocol.md, wire/schema.py):

        prompt: the text to continue, or its token ids
        messages: a chat, e.g. [{"role": "user", "content": "Hi"}] (roles system, user,
            assistant, tool), through the model's chat template
        model: the served model name = its jobs stream [the client's model]
        tools: functions the model may call, OpenAI's [{"type": "function", "function":
            {"name", "description"?, "parameters"?: a JSON Schema}}], up to 128; messages
            only. The output is then text or a JSON array of calls [{"name", "arguments"}]
            (pagedq.wire.tools.calls_of reads it) [none]
        tool_choice: "auto" (text or calls), "required" (calls), "none" (text), or
            {"type": "function", "function": {"name": ...}} (one call of it) [auto]
        parallel_tool_calls: False = at most one call [True]
        max_tokens: most tokens to generate, 0..32768; 0 (with prompt_logprobs) only
            scores the prompt [128]
        temperature: 0 = greedy, up to 100 [1.0]
        top_p: nucleus sampling mass, in (0, 1] [1.0 = off]
        top_k: sample among the k likeliest tokens, -1 = off [-1]
        min_p: drop tokens less likely than min_p x the likeliest one, in [0, 1] [0 = off]
        repetition_penalty: > 1 discourages tokens already in the text, in (0, 10] [1.0]
        presence_penalty: -2..2, lowers tokens already generated [0]
        frequency_penalty: -2..2, lowers tokens by how often they were generated [0]
        stop: a stop string or up to 16 (each 1..256 characters); not in the text [none]
        stop_token_ids: up to 64 token ids that end the job [none]
        seed: this job's sampling seed, 0..2**63-1 [none: the worker's noise stream]
        ignore_eos: keep generating past the end-of-sequence token [False]
        min_tokens: tokens to generate before EOS or a stop may end the job [0]
        logprobs: each token's log-probability and its k likeliest alternatives, 0..20
            [none]
        prompt_logprobs: each prompt token's log-probability given the tokens before it
            (the first has none) and its k likeliest alternatives, 0..20: the job's first
            event's ``prompt_logprobs`` (stream()) [none]
        n: independent samples (choices) of the prompt, 1..16 [1]
        guided: what the output must match, one key: {"json_schema": {...}},
            {"json_object": True}, {"regex": "..."}, {"choice": ["a", "b"]} or
            {"grammar": "<Lark or GBNF>"} (or a GuidedSpec); a spec that cannot compile
            is refused here (InvalidRequest) [none]
        logit_bias: token id -> bias added to its logit, -100..100, up to 300 ids [none]
        priority: order inside a worker's batch, -1000..1000, higher first [0]
        lane: the jobs stream to queue on, one of the workers' lanes [interactive]
        timeout_s: seconds from submission until the job must be done; then it ends with
            finish reason "deadline" [none]
        metadata: up to 16 str -> str pairs kept with the job [none]
        job_id: 1..128 of [A-Za-z0-9_.:-] [a new uuid4 hex]
        require_worker: refuse (NoWorker, nothing enqueued) unless a live worker serves
            the model [False]
        max_completion_tokens, top_logprobs (with logprobs=True), user (-> metadata["user"]),
            response_format (json_object, json_schema -> guided): OpenAI's names; any
            other name is refused (InvalidRequest)
        """
        req, require_worker = submit_params.build(prompt, options, self.model,
                                                  self.settings.partitions)
        return self._submit(req, require_worker)

    def submit_request(self, req: JobRequest | dict[str, Any],
                       require_worker: bool = False) -> str:
        return self._submit(requests.with_id(req, self.model, self.settings.partitions),
                            require_worker)

    def _submit(self, req: JobRequest, require_worker: bool = False) -> str:
        call = scripts.Submit(self.keys, req, self.settings, require_worker)
        return self._retry(script.run, self.redis, call)

    def submit_many(self, reqs: list[JobRequest | dict[str, Any]]) -> list[str]:
        """All requests are validated before anything is sent (InvalidRequest: nothing
        enqueued), then submitted in one pipeline, each atomically but not all together.
        On JobConflict/Overloaded the others are still enqueued; the first error is raised
        with ``.job_ids`` (None where refused). Resubmitting with fixed ids is safe."""
        reqs = [requests.with_id(r, self.model, self.settings.partitions) for r in reqs]
        calls = [scripts.Submit(self.keys, req, self.settings) for req in reqs]
        return requests.collect_replies(self._retry(script.pipelined, self.redis, calls))

    def served_models(self) -> dict[str, int]:
        """Models with at least one live worker -> how many (from the workers'
        heartbeats, judged by Redis's clock)."""
        return self._retry(script.run, self.redis, scripts.Served(self.keys))

    # -- read
    def status(self, job_id: str) -> JobRecord:
        return self._call(reader.read_status(self.keys_of(job_id), job_id))

    def result(self, job_id: str, timeout: float | None = None) -> JobRecord:
        """Wait until the job is terminal; wakes on every new event, never spins."""
        return self._call(reader.wait_result(self.keys_of(job_id), job_id, timeout))

    def stream(self, job_id: str, from_index: int = 0,
               timeout: float | None = None) -> Iterator[Event]:
        """Events from ``from_index`` in index order, each once, ending with the final
        event. ``timeout``: most seconds without a new event (ResultTimeout). Errors
        (JobNotFound, EventsTrimmed) are raised when iteration starts or reaches them."""
        yield from self._drive(reader.read_stream(self.keys_of(job_id), job_id, from_index,
                                                  timeout))

    def stream_text(self, job_id: str, timeout: float | None = None) -> Iterator[str]:
        """Text deltas from the start; they concatenate to the final text."""
        return reader.text_deltas(self.stream(job_id, 0, timeout))

    def subscribe(self, job_id: str, timeout: float | None = None) -> Iterator[Event]:
        """Events from the pub/sub mirror: at-most-once, only those published after the
        subscription; the out stream (stream()) is the source of truth. After a lost
        connection redis-py resubscribes; what was published meanwhile is missed."""
        ps = self.redis.pubsub(ignore_subscribe_messages=True)
        try:
            yield from self._drive(reader.read_mirror(self.keys_of(job_id), job_id, timeout), ps)
        finally:
            ps.close()

    # -- cancel
    def cancel(self, job_id: str) -> bool:
        """True if cancelled (queued) or a cancel was requested (running); False if the
        job had already ended."""
        call = scripts.Cancel(self.keys, requests.checked_id(job_id), self.settings)
        return self._retry(script.run, self.redis, call)

    # -- lifecycle
    def close(self) -> None:
        self.redis.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

