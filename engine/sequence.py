"""A request inside the engine.

Invariant (vLLM v1): ``num_computed_tokens <= num_tokens``; every step the scheduler
hands a request ``num_new_tokens`` so that computed catches up with ``token_ids``. A
request whose computed tokens equal its tokens after a step samples one new token.
Prefill, chunked prefill, prefix-cache hits, decode and recompute after preemption are
all the same loop.

Async scheduling: while a step is in flight, ``token_ids`` may end with a placeholder for
the token it sampled; engine/pipeline.py owns that rule and is the only code that reads
or writes placeholders and ``num_pending_tokens``.

Token ids are held where the garbage collector does not traverse them: ``token_ids`` in
an ``array('q')``, the prompt in a tuple (of ints only: untracked once a collection has
seen it). A running batch's lists of ints, hundreds of thousands of elements, made every
full collection of a busy worker a pause of tens of milliseconds.
"""
from __future__ import annotations

import itertools
from array import array
from dataclasses import dataclass, field
from enum import Enum

from pagedq.engine.outputs import FinishReason
from pagedq.engine.sampling_params import SamplingParams

_arrival = itertools.count()


class SeqStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue, blocks freed, recompute later
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: tuple[int, ...]  # (a list is taken, and kept as a tuple)
    params: SamplingParams
    priority: int = 0  # larger = more important; preemption victim is the lowest
    arrival: int = field(default_factory=lambda: next(_arrival))
    token_ids: array[int] = field(default_factory=lambda: array("q"))
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first schedule)
    block_table: list[int] = field(default_factory=list)
    # hashes of this sequence's full blocks, in order (filled by the block manager)
    block_hashes: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    queued_step: int = 0  # the scheduler's step count when it last entered the waiting queue
    # tokens already produced before this Sequence existed (crash resume): they are part
    # of token_ids but count as output for max_tokens / penalties.
    num_resumed_output: int = 0
    num_pending_tokens: int = 0  # 0 or 1: trailing placeholders (engine/pipeline.py only)
    # params.prompt_logprobs: the entries of prompt positions 0.. scored so far, one per
    # position p (token p + 1 given tokens 0..p); engine/prompt_logprobs.py only
    prompt_lps: list | None = None

    def __post_init__(self) -> None:
        self.prompt_token_ids = tuple(self.prompt_token_ids)
        self.token_ids = array("q", self.token_ids or self.prompt_token_ids)
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:].tolist()

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def scores_prompt(self) -> bool:
        """Its prompt's logprobs are asked for and not all computed: every prompt position
        must be computed here, none served from the prefix cache."""
        return (self.params.prompt_logprobs is not None
                and len(self.prompt_lps or ()) < self.num_prompt_tokens - 1)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
