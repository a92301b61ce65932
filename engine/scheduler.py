"""Continuous-batching scheduler (vLLM v1 style: one invariant, no prefill/decode phases).

Public API:
    Scheduler(config: EngineConfig, num_blocks: int, num_known_tokens=None)
    .bm: BlockManager                        # built here from config (its one block_size)
    .add(seq) -> None                        # ValueError if the prompt can never fit / dup id
    .abort(request_id: str) -> Sequence | None
    .schedule() -> ScheduledBatch
    .update_after_step(batch) -> list[Sequence]   # advances computed; returns seqs that sample
    .finish(seq, reason: str) -> None
    .fits_ever(seq) -> bool, .has_unfinished() -> bool, .can_admit() -> bool
    .num_running, .num_waiting, .num_preemptions_total, .running, .waiting
    .prefix_cache_queries, .prefix_cache_hits  # prompt tokens looked up, served from cache
    .finished_in_schedule: list[Sequence]    # finished by schedule() itself (KV cache overflow)

One step: the token budget (max_num_batched_tokens) goes first to running requests in
queue order, each getting min(num_tokens - num_computed_tokens, budget left) tokens
(chunked prefill and decode alike). If blocks run out, the victim - the last request in
queue order among running requests, maybe the requester itself - is preempted by
recompute and put back in the waiting queue; a step that preempted admits nobody. Otherwise
waiting requests are admitted in queue order while budget, seats (max_num_seqs) and
blocks allow; the first one that does not fit stops admission (head-of-line, so a big
request is never starved by small ones). A step in which every running request only
decodes admits only once the queue's head was held config.prefill_wait_steps steps, or
the queue would take every free seat, or the head outranks a running request: arrivals
are then prefilled together in one step instead of making many steps prefill (with CUDA
graphs a step that prefills costs several decode steps). A step that prefills anyway
admits at once.

Queue order is the policy (config.scheduling_policy): "fcfs" = arrival; "priority" =
(-priority, arrival), and a waiting request that finds no seat or no blocks preempts the
running request last in queue order if that one has a strictly lower priority (as vLLM's
priority policy does): an interactive job displaces a batch job instead of waiting for it.

Call order per step: schedule() -> run the model -> update_after_step() -> append the
sampled tokens -> finish()/abort(). finish/abort must not run between schedule() and
update_after_step(): the batch still refers to the sequences' block tables. With async
scheduling (engine/pipeline.py) update_after_step() runs as soon as the step is launched,
and the sampled tokens arrive one call later (as placeholders meanwhile).
"""
from __future__ import annotations

from bisect import insort_left, insort_right
from collections.abc import Callable

from pagedq.engine.batch import ScheduledBatch
from pagedq.engine.block_manager import BlockManager
from pagedq.engine.config import EngineConfig
from pagedq.engine.outputs import FinishReason
from pagedq.engine.sequence import SeqStatus, Sequence

RUNNING = SeqStatus.RUNNING
MAX_HELD_STEPS = 4  # see schedule(): lower-priority prefills wait at most this many steps


def _priority_key(s: Sequence) -> tuple[int, int]:
    """Queue order of the priority policy (ascending); max() over running = the victim."""
    return (-s.priority, s.arrival)


def _arrival_key(s: Sequence) -> int:
    return s.arrival


class Scheduler:
    def __init__(self, config: EngineConfig, num_blocks: int,
                 num_known_tokens: Callable[[Sequence], int] | None = None) -> None:
        """``num_known_tokens``: see BlockManager (async scheduling's placeholders)."""
        if config.max_num_seqs < 1 or config.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.config = config
        # the block manager takes block_size from the config, as the runner that sizes the
        # KV cache does: one source
        self.bm = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching,
                               num_known_tokens)
        self.by_priority = config.scheduling_policy == "priority"
        self._key = _priority_key if self.by_priority else _arrival_key  # queue order
        self.waiting: list[Sequence] = []  # in queue order
        self.running: list[Sequence] = []  # in queue order
        self.requests: dict[str, Sequence] = {}  # every unfinished request
        self.num_preemptions_total = 0
        # at each request's first admission (a resumed one re-hitting itself is no query)
        self.prefix_cache_queries = self.prefix_cache_hits = 0
        self.finished_in_schedule: list[Sequence] = []
        self._held_steps = 0  # consecutive steps that held lower-priority prefills back
        self._steps = 0  # schedule() calls so far: the clock of prefill_wait_steps
        # tokens one step may compute; a caller on a slow device may lower it (never above
        # max_num_batched_tokens) so that each step stays short: LLMEngine.set_step_budget
        self.step_token_budget = config.max_num_batched_tokens

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    def fits_ever(self, seq: Sequence) -> bool:
        """Whether the whole KV cache can hold seq's tokens plus one more."""
        return seq.num_tokens + 1 <= self.bm.capacity_tokens

    def can_admit(self) -> bool:
        """A new request could likely be admitted: a seat under max_num_seqs left after the
        queue, and free blocks beyond what the waiting requests need."""
        if len(self.running) + len(self.waiting) >= self.config.max_num_seqs:
            return False
        bs = self.bm.block_size
        needed = sum(-(-(s.num_tokens + 1) // bs) for s in self.waiting)
        return self.bm.num_free_blocks > needed

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self.requests:
            raise ValueError(f"request {seq.request_id!r} is already scheduled")
        if seq.is_finished or seq.block_table or seq.num_computed_tokens:
            raise ValueError(f"request {seq.request_id!r} must be new (no blocks, none computed)")
        if not seq.token_ids:
            raise ValueError(f"request {seq.request_id!r} has an empty prompt")
        if not self.fits_ever(seq):
            raise ValueError(
                f"request {seq.request_id!r}: {seq.num_tokens} prompt tokens cannot fit in the KV "
                f"cache ({self.bm.num_blocks} blocks x {self.bm.block_size} tokens = "
                f"{self.bm.capacity_tokens} tokens, one is kept for the first output token)")
        seq.status = SeqStatus.WAITING
        seq.queued_step = self._steps
        self.requests[seq.request_id] = seq
        insort_right(self.waiting, seq, key=self._key)

    def _remove(self, seq: Sequence, reason: FinishReason) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.requests.pop(seq.request_id, None)
        self.bm.free(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason

    def abort(self, request_id: str) -> Sequence | None:
        """Free the request's blocks at once; None if unknown or already finished."""
        seq = self.requests.get(request_id)
        if seq is None:
            return None
        self._remove(seq, FinishReason.abort)
        return seq

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Idempotent: finishing an already finished (e.g. aborted) request does nothing."""
        if seq.is_finished:
            return
        if self.requests.get(seq.request_id) is not seq:
            raise ValueError(f"request {seq.request_id!r} is not in this scheduler")
        self._remove(seq, reason)

    def _preempt(self, victim: Sequence, batch: ScheduledBatch) -> int:
        """Recompute-preempt victim; returns the budget it gave back if already scheduled."""
        refund = 0
        if victim in batch.seqs:
            j = batch.seqs.index(victim)
            del batch.seqs[j]
            refund = batch.num_new_tokens.pop(j)
        self.running.remove(victim)
        self.bm.free(victim)  # before resetting computed: uncaches blocks never written
        victim.num_computed_tokens = 0
        victim.status = SeqStatus.PREEMPTED
        victim.queued_step = self._steps
        victim.num_preemptions += 1
        self.num_preemptions_total += 1
        insort_left(self.waiting, victim, key=self._key)  # ahead of later arrivals
        batch.preempted.append(victim)
        return refund

    def _drop_overflow(self, seq: Sequence) -> bool:
        """A request grown past the whole KV cache can never be computed again: finish it
        with "length" (reported in finished_in_schedule) instead of blocking the queue."""
        if seq.num_tokens <= self.bm.capacity_tokens:
            return False
        self._remove(seq, FinishReason.length)
        self.finished_in_schedule.append(seq)
        return True

    def schedule(self) -> ScheduledBatch:
        cfg, bm = self.config, self.bm
        batch = ScheduledBatch()
        self.finished_in_schedule = []
        budget = self.step_token_budget
        self._steps += 1
        prefills = False  # does a running request get a prefill chunk this step

        # Priority policy: once a step prefills a request, requests of lower priority get only
        # their decode token in it (no prefill chunk, no admission), so a higher request's
        # first token follows a short step, not a long batch of lower prefills. At most
        # MAX_HELD_STEPS steps in a row hold lower prefills back: they are never starved.
        hold = self.by_priority and self._held_steps < MAX_HELD_STEPS
        # the highest priority this step prefills: the first waiting request's (admitting is
        # prefilling), or a running one's (running is in queue order: the first prefill)
        floor = self.waiting[0].priority if hold and self.waiting else None
        held = False

        # hot loop (every running request, every step): locals, no property calls
        running, capacity, chunked = RUNNING, bm.capacity_tokens, cfg.enable_chunked_prefill
        allocate, seqs, counts = bm.allocate_slots, batch.seqs, batch.num_new_tokens
        for seq in list(self.running):
            if seq.status is not running:
                continue  # preempted earlier in this loop
            num_tokens = len(seq.token_ids)
            if num_tokens > capacity and self._drop_overflow(seq):
                continue
            left = num_tokens - seq.num_computed_tokens
            if left > 1 and hold:
                if floor is None or seq.priority > floor:
                    floor = seq.priority
                elif seq.priority < floor:
                    held = True
                    continue
            n = left if left < budget else budget
            if n <= 0 or (n < left and not chunked):
                continue
            while not allocate(seq, n):
                victim = self.running[-1]
                budget += self._preempt(victim, batch)
                if victim is seq:
                    break
            else:
                seqs.append(seq)
                counts.append(n)
                budget -= n
                prefills = prefills or n > 1

        # a step whose running requests ran short of blocks admits nobody (it would thrash)
        kv_short = bool(batch.preempted)
        wait = bool(self.waiting and seqs and not prefills and self._hold_arrivals())
        while not kv_short and not wait and self.waiting and budget > 0:
            seq = self.waiting[0]
            if hold and floor is not None and seq.priority < floor:
                held = True
                break
            if self._drop_overflow(seq):
                continue
            if len(self.running) >= cfg.max_num_seqs:
                if not self._outranks(seq):
                    break
                budget += self._preempt(self.running[-1], batch)
                continue
            computed, num_hit = bm.get_computed_blocks(seq)
            n = seq.num_tokens - num_hit
            if n > budget:
                if not cfg.enable_chunked_prefill:
                    break
                n = budget
            if not bm.allocate_slots(seq, n, computed):
                if not self._outranks(seq):
                    break
                budget += self._preempt(self.running[-1], batch)
                continue  # look up the prefix again: the victim's blocks were freed
            self.waiting.pop(0)
            if seq.num_preemptions == 0 and cfg.enable_prefix_caching:
                self.prefix_cache_queries += seq.num_prompt_tokens
                self.prefix_cache_hits += seq.num_cached_tokens
            seq.status = SeqStatus.RUNNING
            insort_right(self.running, seq, key=self._key)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        self._held_steps = self._held_steps + 1 if held else 0
        return batch

    def _hold_arrivals(self) -> bool:
        """In a decode-only step: should the waiting requests wait for a later step?"""
        wait, head = self.config.prefill_wait_steps, self.waiting[0]
        if not wait or self._steps - head.queued_step > wait:  # held `wait` steps already
            return False
        seats = self.config.max_num_seqs - len(self.running)
        return len(self.waiting) < seats and not self._outranks(head)

    def _outranks(self, seq: Sequence) -> bool:
        """Priority policy: may waiting ``seq`` preempt the last running request?"""
        return self.by_priority and bool(self.running) and \
            self.running[-1].priority < seq.priority

    def update_after_step(self, batch: ScheduledBatch) -> list[Sequence]:
        """Advance num_computed_tokens by what ran; returns the sequences that sample now
        (computed == num_tokens), i.e. those for which batch.samples(i) was True."""
        sampling = []
        running = RUNNING
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            if seq.status is not running:
                continue
            computed = seq.num_computed_tokens = seq.num_computed_tokens + n
            num_tokens = len(seq.token_ids)
            if computed >= num_tokens:
                if computed > num_tokens:
                    raise RuntimeError(f"{seq.request_id}: computed {computed} "
                                       f"> {num_tokens} tokens")
                sampling.append(seq)
        return sampling
