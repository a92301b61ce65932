"""Async scheduling (vLLM v1 style): the next step is scheduled and launched before the
sampled token ids of the step on the device reach the host.

One ``LLMEngine.step()`` call k:
  1. expect: each sequence that sampled in step k-1 (launched by the previous call, maybe
     still running on the device) gets a PLACEHOLDER token (sequence.py), so the scheduler
     sees the right counts; or, if that token is certainly its last (max_tokens, context
     length), it is finished at once, freeing its blocks exactly when the synchronous
     engine would have.
  2. schedule step k; 3. launch step k: inputs (placeholders are gathered on the device
     from step k-1's sampled-token tensor), forward, sampling, and a non-blocking copy of
     the sampled ids into pinned host memory;
  4. collect step k-1: wait for its copy, fill the placeholders, stop checks, detokenize,
     outputs. Host work 4 (and 1-3 of call k+1) overlaps the device running step k.

Invariants:
  * At most one step in flight. Between calls no sequence holds a placeholder: tokens
    sampled by the step in flight are not in ``token_ids`` yet (num_tokens ==
    num_computed_tokens for them).
  * A sequence that stops on the value of its step k-1 token (EOS, stop token, stop
    string) was scheduled again in step k (speculatively). When step k is collected its
    request is no longer live, so that extra token is dropped: never published, never
    counted; its KV slot went with the blocks freed at finish. An aborted request's
    in-flight token is dropped the same way (liveness is checked by Sequence identity).
  * A step stays in flight only if none of its sampling rows needs host-side token values
    before the next step: penalties (the sampler reads output ids) and logprobs (computed
    with host syncs) make that step synchronous (collected in the same call).
  * All device work is on one stream: the in-flight step's K/V writes precede any later
    use of blocks freed and re-allocated meanwhile (abort, finish, preemption).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


@dataclass(slots=True, eq=False)
class InFlight:
    """One launched step's sampled tokens."""

    seqs: list[Sequence]  # the rows that sampled, in logits order
    host: torch.Tensor | list[int]  # ids: pinned copy being filled (CUDA) or ready
    tokens: torch.Tensor | None = None  # [R] int64 on the device (None if synchronous)
    event: Any = None  # torch.cuda.Event recorded after the copy
    logprobs: list[Any] | None = None
    index: dict[Sequence, int] | None = None  # seq -> row in tokens (async only)

    @property
    def is_async(self) -> bool:
        return self.tokens is not None

    def token_ids(self) -> list[int]:
        """The sampled ids (waits for the device copy)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host if isinstance(self.host, list) else self.host.tolist()


def needs_host_values(p: SamplingParams) -> bool:
    """Sampling this request needs its earlier tokens' values, or reports logprobs."""
    return (p.logprobs is not None or p.repetition_penalty != 1.0
            or bool(p.presence_penalty) or bool(p.frequency_penalty))


def launch(runner, sampler, scheduler, batch, prev: InFlight | None,
           allow_async: bool) -> InFlight | None:
    """Run ``batch`` on the device (reading placeholders from ``prev``), advance the
    scheduler, sample; None if no row samples. Returns without waiting for the device
    unless a sampling row needs host values (or ``allow_async`` is False)."""
    logits = runner.execute(batch, prev.index if prev is not None else None,
                            prev.tokens if prev is not None else None)
    sampling = scheduler.update_after_step(batch)
    if not sampling:
        return None
    if not allow_async or any(needs_host_values(s.params) for s in sampling):
        out = sampler(logits, sampling)
        return InFlight(sampling, out.token_ids, logprobs=out.logprobs)
    tokens = sampler.sample(logits, sampling)
    index = {s: j for j, s in enumerate(sampling)}
    if not tokens.is_cuda:
        return InFlight(sampling, tokens, tokens, index=index)
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return InFlight(sampling, host, tokens, event, index=index)
