"""Async scheduling (vLLM v1 style): the next step is scheduled and launched before the
sampled token ids of the step on the device reach the host.

``StepPipeline`` is the one owner of the step in flight and of its placeholders (as
vLLM's AsyncScheduler). One ``LLMEngine.step()`` call k:
  1. ``expect``: each sequence that sampled in step k-1 (launched by the previous call,
     maybe still running on the device) gets a ``PLACEHOLDER`` token, so the scheduler
     sees the right counts; or, if that token is certainly its last (max output, context
     length), it is finished at once, freeing its blocks exactly when the synchronous
     engine would have.
  2. schedule step k; 3. ``launch`` step k: inputs (placeholders are gathered on the
     device from step k-1's sampled-token tensor), forward, sampling, and a non-blocking
     copy of the sampled ids into pinned host memory;
  4. ``collect`` step k-1: wait for its copy, fill the placeholders, then the engine's
     stop checks, detokenization, outputs. Host work 4 (and 1-3 of call k+1) overlaps the
     device running step k.

Placeholders: while the step that sampled a sequence's newest token is on the device,
``seq.token_ids`` ends with ONE ``PLACEHOLDER`` entry and ``seq.num_pending_tokens == 1``;
its value lives only in that step's device tensor. Counts (num_tokens, num_output_tokens)
include it. Only this module reads or writes either; the others see them through:
  * ``num_known_tokens(seq)``, given to the block manager: prefix-cache blocks are
    registered only among the tokens the host knows; the block a placeholder completes is
    registered when ``collect`` fills it in (``BlockManager.cache_resolved_block``);
  * the in-flight step's row index and device tokens, handed to ``ModelRunner.execute``:
    a sampling row whose sequence is in that index takes its last input token from the
    device (engine/inputs.py).

Invariants:
  * At most one step in flight. Between calls no sequence holds a placeholder: tokens
    sampled by the step in flight are not in ``token_ids`` yet (num_tokens ==
    num_computed_tokens for them). A placeholder is always the last entry, and it is
    filled in before the engine publishes anything for the sequence.
  * A sequence that stops on the value of its step k-1 token (EOS, stop token, stop
    string) was scheduled again in step k (speculatively). When step k is collected its
    request is no longer live, so that extra token is dropped: never published, never
    counted; its KV slot went with the blocks freed at finish. An aborted request's
    in-flight token is dropped the same way (liveness is checked by Sequence identity).
  * A step stays in flight only if none of its sampling rows needs host-side token values
    before the next step: penalties (the sampler reads output ids) and logprobs (computed
    with host syncs) make that step synchronous (collected in the same call). A step that
    computes prompt positions to score (engine/prompt_logprobs.py) reads their logits
    back in ``launch`` itself, before it samples.
  * Guided rows (engine/guided.py) do not: their grammar masks need the value of the
    token before, so ``launch`` reads the step in flight's token ids once the forward
    pass is queued (the wait ``collect`` would have made next), advances the matchers and
    builds the masks on the host while the device runs the forward, then queues the
    sampling. The next step still launches before this one's tokens reach the host.
  * All device work is on one stream: the in-flight step's K/V writes precede any later
    use of blocks freed and re-allocated meanwhile (abort, finish, preemption).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from pagedq.engine import prompt_logprobs
from pagedq.engine.outputs import FinishReason
from pagedq.engine.sampling_params import SamplingParams
from pagedq.engine.sequence import SeqStatus, Sequence

if TYPE_CHECKING:
    from pagedq.engine.batch import ScheduledBatch
    from pagedq.engine.guided import GuidedDecoding, GuidedMask
    from pagedq.engine.model_runner import ModelRunner
    from pagedq.engine.outputs import StepOutput
    from pagedq.engine.sampler import Sampler
    from pagedq.engine.scheduler import Scheduler

PLACEHOLDER = -1  # token_ids entry of a sampled token not yet copied to the host
RUNNING = SeqStatus.RUNNING


def num_known_tokens(seq: Sequence) -> int:
    """How many of seq's tokens have their values on the host (all but a placeholder)."""
    return len(seq.token_ids) - seq.num_pending_tokens


def needs_host_values(p: SamplingParams) -> bool:
    """Sampling this request needs its earlier tokens' values, or reports logprobs."""
    return (p.logprobs is not None or p.repetition_penalty != 1.0
            or bool(p.presence_penalty) or bool(p.frequency_penalty))


class Request(Protocol):
    """What the pipeline reads of the engine's entry for a live request."""

    seq: Sequence  # the request's current Sequence: a row of another one is dropped
    max_output: int  # output tokens allowed (max_tokens clipped to the context left)


@dataclass(slots=True, eq=False)
class InFlight:
    """One launched step's sampled tokens."""

    seqs: list[Sequence]  # the rows that sampled, in logits order
    host: torch.Tensor | list[int]  # ids: pinned copy being filled (CUDA) or ready
    tokens: torch.Tensor | None = None  # [R] int64 on the device (None if synchronous)
    event: Any = None  # torch.cuda.Event recorded after the copy
    logprobs: list[Any] | None = None
    index: dict[Sequence, int] | None = None  # seq -> row in tokens (async only)
    ids: list[int] | None = None  # token_ids(), once read

    def token_ids(self) -> list[int]:
        """The sampled ids (waits for the device copy)."""
        if self.ids is None:
            if self.event is not None:
                self.event.synchronize()
            self.ids = self.host if isinstance(self.host, list) else self.host.tolist()
        return self.ids


class StepPipeline:
    """Launches steps and owns the one in flight: which of its rows get a token, their
    placeholders, and dropping the tokens of rows finished or aborted since launch.

    ``requests`` is the engine's map of live requests (request_id -> ``Request``), read
    only. The engine owns the pipeline, never the other way round: nothing here refers
    back to the engine (its per-token output step is passed to each ``collect``), so the
    engine, and the device memory under it, is freed by reference counting alone.
    ``guided`` holds the grammar matchers of guided sequences."""

    def __init__(self, runner: ModelRunner, sampler: Sampler, scheduler: Scheduler,
                 requests: Mapping[str, Request], max_model_len: int,
                 allow_async: bool, guided: GuidedDecoding) -> None:
        self.runner, self.sampler, self.scheduler = runner, sampler, scheduler
        self.guided = guided
        self.bm = scheduler.bm
        self.requests = requests
        self.max_model_len = max_model_len
        self.allow_async = allow_async
        self.inflight: InFlight | None = None  # the async step launched, not yet collected
        self.device_wait_s = 0.0  # host time spent waiting for sampled tokens (stats)
        # live requests asking for prompt logprobs (the engine counts them): steps plan
        # the prompt positions to score only while there are some
        self.scoring = 0

    def expect(self) -> InFlight | None:
        """Before scheduling: take the step in flight (None if none); each of its rows
        still running will get a token, so it gets a placeholder, or is finished now if
        that token certainly is its last. Rows finished or aborted since are skipped:
        their tokens will be dropped."""
        prev, self.inflight = self.inflight, None
        if prev is None:
            return None
        requests, max_len, running = self.requests, self.max_model_len, RUNNING
        for seq in prev.seqs:
            if seq.status is not running:
                continue
            n = len(seq.token_ids) + 1
            if n - seq.num_prompt_tokens >= requests[seq.request_id].max_output \
                    or n >= max_len:
                self.scheduler.finish(seq, FinishReason.length)  # certainly its last token
            else:
                seq.token_ids.append(PLACEHOLDER)
                seq.num_pending_tokens = 1
        return prev

    def launch(self, batch: ScheduledBatch, prev: InFlight | None) -> InFlight | None:
        """Run ``batch`` on the device (reading placeholders from ``prev``), advance the
        scheduler, sample. A step that may stay in flight is kept (collected by the next
        call's ``collect(prev)``) and None returned; a synchronous one (a row needs host
        values, or async scheduling is off) is returned for collecting now. None also if
        no row samples."""
        scored = prompt_logprobs.plan(batch) if self.scoring else None
        logits = self.runner.execute(batch, prev.index if prev is not None else None,
                                     prev.tokens if prev is not None else None)
        if scored:  # the logits' tail rows: prompt positions (read back now: synchronous)
            logits = prompt_logprobs.score(scored, logits, self.runner.vocab_size)
        sampling = self.scheduler.update_after_step(batch)
        if not sampling:
            return None
        masks = self._masks(sampling, prev) if self.guided else None
        if not self.allow_async or any(needs_host_values(s.params) for s in sampling):
            out = self.sampler(logits, sampling, masks)
            return InFlight(sampling, out.token_ids, logprobs=out.logprobs)
        tokens = self.sampler.sample(logits, sampling, masks)
        index = {s: j for j, s in enumerate(sampling)}
        if not tokens.is_cuda:
            self.inflight = InFlight(sampling, tokens, tokens, index=index)
            return None
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.inflight = InFlight(sampling, host, tokens, event, index=index)
        return None

    def _masks(self, sampling: list[Sequence], prev: InFlight | None) -> GuidedMask | None:
        """The grammar masks of the guided rows among ``sampling``; a row whose last token
        is still a placeholder takes its value from ``prev`` (waiting for its copy)."""
        pending: dict[Sequence, int] = {}
        if prev is not None and prev.index is not None:
            waiting = [s for s in sampling if s.num_pending_tokens and s in self.guided]
            if waiting:
                ids = self._wait(prev)
                pending = {s: ids[prev.index[s]] for s in waiting}
        return self.guided.masks(sampling, pending)

    def _wait(self, rec: InFlight) -> list[int]:
        t0 = time.perf_counter()
        ids = rec.token_ids()
        self.device_wait_s += time.perf_counter() - t0
        return ids

    def collect(self, rec: InFlight,
                advance: Callable[[Any, int, Any], StepOutput]) -> list[StepOutput]:
        """Outputs of a launched step's tokens: each row still live gets its token (its
        placeholder filled in, else appended), then ``advance(request, token_id,
        logprobs)`` (the engine's stop checks and detokenization); other rows are dropped."""
        outs = []
        get, bm = self.requests.get, self.bm
        bs = bm.block_size
        lps = rec.logprobs or [None] * len(rec.seqs)
        ids = self._wait(rec)
        self.runner.check_healthy()  # tensor-parallel: a peer died under this step
        for seq, tok, lp in zip(rec.seqs, ids, lps, strict=True):
            req = get(seq.request_id)
            if req is None or req.seq is not seq:
                continue  # finished or aborted since launch
            toks = seq.token_ids
            if seq.num_pending_tokens:
                toks[-1] = tok
                seq.num_pending_tokens = 0
                if len(toks) % bs == 0:  # it completes a block: cache that now
                    bm.cache_resolved_block(seq)
            else:
                toks.append(tok)
            outs.append(advance(req, tok, lp))
        return outs

    def close(self) -> None:
        """Drop what holds device memory: the step in flight (its sampled tokens) and the
        sampler (the penalised rows' prompt ids). The pipeline launches nothing after."""
        self.inflight = None
        self.sampler = None
