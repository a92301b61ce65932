"""LLMEngine: the scheduler, model runner and sampler stepped together.

One ``step()`` = schedule a token budget -> one forward pass -> sample the sequences
that caught up -> detokenize, check stops -> free finished requests. Requests may be
added and aborted between any two steps; a request added now joins the next step.
With async scheduling (the default, engine/pipeline.py) a step's tokens are returned by
the next ``step()`` call, while the device runs that next step.

Lifetime: ``close()``, or leaving ``with LLMEngine(...) as llm:``, releases the device at
once (weights, KV cache, CUDA graphs and their pools, input buffers, the step in flight)
and stops the tensor-parallel ranks; every later call raises ``EngineClosed`` naming the
call. An engine dropped without close() is released the moment its last reference goes:
no reference cycle runs through it (the engine owns its parts; none refers back), so
reference counting frees it, ``gc`` never has to. close() from another thread while a
call runs here (``step``, ``generate``, ``add_request``, ``abort_request``) waits for that
call's current step to end, then releases; that thread's next step raises EngineClosed.
A constructor that fails releases what it had built before the error propagates.
"""
from __future__ import annotations

import contextlib
import gc
import threading
import traceback
from dataclasses import dataclass
from itertools import repeat
from typing import Any

from pagedq.engine import prompt_logprobs
from pagedq.engine.config import EngineConfig, engine_config
from pagedq.engine.detokenizer import OutputStream
from pagedq.engine.errors import EngineClosed
from pagedq.engine.guided import GuidedDecoding
from pagedq.engine.model_runner import ModelRunner
from pagedq.engine.offline import OfflineMixin
from pagedq.engine.outputs import FinishReason, StepOutput
from pagedq.engine.pipeline import StepPipeline, num_known_tokens
from pagedq.engine.sampler import Sampler
from pagedq.engine.sampling_params import SamplingParams, fan_out, split_sample_id
from pagedq.engine.scheduler import Scheduler
from pagedq.engine.sequence import Sequence

# EngineConfig.prefill_wait_steps by default: arrivals gathered for up to this many steps
# while the batch decodes. H200, 192 sequences decoding, one new 512-token prompt before
# every step (bench/mixed_steps.py): in piecewise CUDA graphs (engine/piecewise.py) 7.8 ms
# per step, 6.9 with a wait of 16, against 4.6 decode only: 4 where they were captured;
# run eagerly (tensor-parallel) 20.5 ms: 16 where only the decode graphs were
PREFILL_WAIT_STEPS = 4
EAGER_PREFILL_WAIT_STEPS = 16


class _NoText:
    """Output stream of a model without a tokenizer: token ids only, no text."""

    def push(self, token_id: int) -> tuple[str, bool]:
        return "", False

    def finish(self) -> str:
        return ""


@dataclass(slots=True)
class _Live:
    seq: Sequence
    stream: OutputStream | _NoText
    max_output: int  # params.max_tokens clipped to the context left


class LLMEngine(OfflineMixin):
    def __init__(self, model: str = "smollm2", *, config: EngineConfig | None = None,
                 **options: Any) -> None:
        self._closed = False
        self._lock = threading.RLock()  # held by a call that steps or changes requests
        self._calls = 0  # such calls under way in this thread (close() from a signal handler)
        self.config = engine_config(config, options)  # the runner's too: one object
        try:
            self.runner = ModelRunner(model, self.config)
        except BaseException as e:
            _forget_frames(e)
            raise
        try:
            self._build()
        except BaseException as e:
            with contextlib.suppress(Exception):  # the error to report is the first
                self.runner.close()  # tensor-parallel ranks must not outlive a failed engine
            _forget_frames(e)
            raise
        # A first model load's imports (transformers' lazy modules, torchvision's) leave
        # reference cycles of dead frames whose f_back chain reaches this frame, and so self:
        # in a process whose collector is off they kept the whole engine after `del` (issue
        # 37: 6.7 GiB on the H200). Collected here, once per engine (~0.2 s).
        gc.collect()

    def _build(self) -> None:
        self.tokenizer = self.runner.tokenizer
        self.max_model_len = self._fit_max_model_len()
        self.eos_token_ids = set(self.runner.eos_token_ids)
        if self.config.prefill_wait_steps is None:
            self.config.prefill_wait_steps = (
                PREFILL_WAIT_STEPS if self.runner.piecewise is not None
                else EAGER_PREFILL_WAIT_STEPS if self.runner.graphs else 0)
        self.scheduler = Scheduler(self.config, self.runner.num_kv_blocks, num_known_tokens)
        self.block_manager = self.scheduler.bm
        self._live: dict[str, _Live] = {}
        # request id of an n > 1 request -> the ids of its samples still live ("id#k"): the
        # duplicate check and abort_request find a request's samples without a scan of
        # every live request (O(running) per admission before)
        self._samples: dict[str, set[str]] = {}
        sampler = Sampler(self.runner.vocab_size, self.eos_token_ids, self.config.seed)
        self.guided = GuidedDecoding(self.tokenizer, self.runner.vocab_size, self.eos_token_ids,
                                     pin_memory=self.runner.device.type == "cuda")
        self.pipeline = StepPipeline(self.runner, sampler, self.scheduler, self._live,
                                     self.max_model_len, self._async(), self.guided)
        self.last_step_tokens = 0  # tokens computed by the step the last step() launched

    # ---- lifetime -------------------------------------------------------------------
    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the device now (weights, KV cache, CUDA graphs, buffers; on CUDA the
        freed memory goes back to the driver) and stop the tensor-parallel rank processes.
        Idempotent. A call running in another thread ends its current step first; every
        later call raises EngineClosed. Also done at interpreter exit (tensor-parallel)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._calls:  # from inside a call of this thread (a signal handler): the
                return       # call releases when it returns (_using)
            self._release()

    def _release(self) -> None:
        """Drop everything that holds memory (idempotent)."""
        self._live.clear()
        self._samples.clear()
        self.pipeline.close()
        self.runner.close()

    @property
    def closed(self) -> bool:
        """True once close() was called (the release may wait for a step under way)."""
        return self._closed

    @contextlib.contextmanager
    def _using(self, call: str):
        """Hold the engine for ``call`` (EngineClosed once closed); a close() that came
        meanwhile from this thread releases at the end."""
        with self._lock:
            self._calls += 1
            try:
                if self._closed:
                    raise EngineClosed(call)
                yield
            finally:
                self._calls -= 1
                if self._closed and not self._calls:
                    self._release()

    def _check_open(self, call: str) -> None:
        if self._closed:
            raise EngineClosed(call)

    def _async(self) -> bool:
        on = self.config.async_scheduling
        return self.runner.device.type == "cuda" if on is None else on

    def _fit_max_model_len(self) -> int:
        """One sequence of max_model_len tokens must fit the KV cache: an explicit
        max_model_len that cannot is an error; the model's default is lowered to fit."""
        capacity = self.runner.num_kv_blocks * self.config.block_size
        wanted = self.runner.max_model_len
        if wanted <= capacity:
            return wanted
        if self.config.max_model_len is not None:
            raise ValueError(
                f"max_model_len {wanted} needs {wanted} tokens of KV cache but only {capacity} "
                f"fit ({self.runner.num_kv_blocks} blocks of {self.config.block_size}): lower "
                f"max_model_len or give the cache more memory (num_kv_blocks, "
                f"kv_cache_memory_gb, gpu_memory_utilization)")
        return capacity

    # ---- requests -------------------------------------------------------------------
    def encode(self, prompt: str | list[int] | None = None,
               messages: list[dict[str, str]] | None = None) -> list[int]:
        """Token ids of a text prompt, a token-id prompt, or chat messages (chat template)."""
        self._check_open("encode")
        if self.tokenizer is None and (messages is not None or isinstance(prompt, str)):
            raise ValueError("this model has no tokenizer: give prompts as token ids")
        if messages is not None:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                     tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return list(ids)
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        # map() keeps the per-id check in C: a generator cost ~0.2 ms per 600-id prompt,
        # on the worker's engine thread at every admission
        if isinstance(prompt, list) and all(map(isinstance, prompt, repeat(int))):
            return list(prompt)
        raise ValueError("prompt must be text, a list of token ids, or chat messages")

    def add_request(self, request_id: str, prompt: str | list[int] | None = None,
                    params: SamplingParams | None = None, *,
                    messages: list[dict[str, str]] | None = None, priority: int = 0,
                    resume_token_ids: list[int] | None = None) -> int:
        """Queue a request; returns its prompt length. Raises ValueError for bad input
        (empty prompt, prompt that does not fit the context, token ids out of vocab, a
        guided spec that does not compile, logit_bias ids out of vocab).

        ``resume_token_ids``: output tokens an earlier attempt already produced (crash
        resume); they are re-prefilled, not re-emitted, and count toward max_tokens; a
        guided request's grammar consumes them here (ValueError if it refuses them).
        """
        with self._using("add_request"):
            params = params or SamplingParams()
            samples = fan_out(request_id, params)
            if request_id in self._live or request_id in self._samples or any(
                    rid in self._live for rid, _ in samples):
                raise ValueError(f"request {request_id!r} already exists")
            ids = self.encode(prompt, messages)
            if not ids:
                raise ValueError("prompt is empty after tokenization")
            vocab = self.runner.vocab_size
            if min(ids) < 0 or max(ids) >= vocab:
                raise ValueError(f"prompt token ids must be in [0, {vocab})")
            resumed = list(resume_token_ids or [])
            total = len(ids) + len(resumed)
            if total >= self.max_model_len:
                raise ValueError(f"prompt has {len(ids)} tokens (+{len(resumed)} resumed); the "
                                 f"model's context is {self.max_model_len} tokens")
            if params.logit_bias and max(params.logit_bias) >= vocab:
                raise ValueError(f"logit_bias token ids must be in [0, {vocab})")
            guide = (self.guided.start(params.guided, resumed) if params.guided is not None
                     else None)
            max_output = min(params.max_tokens, self.max_model_len - len(ids))
            for k, (rid, p) in enumerate(samples):
                seq = Sequence(rid, ids, p, priority=priority, token_ids=ids + resumed)
                seq.num_resumed_output = len(resumed)
                stream = (OutputStream(self.tokenizer, p, ids) if self.tokenizer is not None
                          else _NoText())
                for t in resumed:  # replay, discarding text the earlier attempt already emitted
                    stream.push(t)
                if guide is not None:
                    self.guided.attach(seq, guide, copy=k > 0)
                self.scheduler.add(seq)
                self._live[rid] = _Live(seq, stream, max_output)
                self.pipeline.scoring += p.prompt_logprobs is not None  # (a count)
            if len(samples) > 1:
                self._samples[request_id] = {rid for rid, _ in samples}
            return len(ids)

    def abort_request(self, request_id: str) -> bool:
        """Abort a request (all its samples); its KV blocks are freed at once."""
        with self._using("abort_request"):
            rids = [request_id] if request_id in self._live else \
                sorted(self._samples.get(request_id, ()))
            for rid in rids:
                self.scheduler.abort(rid)
                self._drop(rid)
            return bool(rids)

    def _drop(self, rid: str) -> _Live:
        """Forget a live request (finished or aborted), and its sample's place in its group."""
        live = self._live.pop(rid)
        self.guided.drop(live.seq)
        self.pipeline.scoring -= live.seq.params.prompt_logprobs is not None
        base = split_sample_id(rid)[0]
        group = self._samples.get(base)
        if group is not None and rid in group:
            group.remove(rid)
            if not group:
                del self._samples[base]
        return live

    def has_unfinished(self) -> bool:
        self._check_open("has_unfinished")
        return bool(self._live)

    def can_admit(self) -> bool:
        self._check_open("can_admit")
        return self.scheduler.can_admit()

    @property
    def num_running(self) -> int:
        self._check_open("num_running")
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        self._check_open("num_waiting")
        return self.scheduler.num_waiting

    @property
    def kv_cache_usage(self) -> float:
        self._check_open("kv_cache_usage")
        return self.block_manager.usage

    @property
    def device_wait_s(self) -> float:
        """Host time spent waiting for sampled tokens (stats)."""
        self._check_open("device_wait_s")
        return self.pipeline.device_wait_s

    def set_failure_handler(self, callback) -> None:
        """Tensor-parallel: ``callback(error)`` runs as soon as a rank process dies, idle
        or not, on a monitor thread (or on the stepping thread when its step met the death
        first); every later step raises the same distributed.TensorParallelError. No-op
        with one rank."""
        self._check_open("set_failure_handler")
        self.runner.set_failure_handler(callback)

    def set_step_budget(self, tokens: int) -> int:
        """Limit the tokens one step computes (prefill chunks + decodes) to ``tokens``,
        clipped to [1, max_num_batched_tokens]; returns the budget in force. Lets a caller
        keep steps short on a slow device without changing the engine's configuration."""
        self._check_open("set_step_budget")
        budget = max(1, min(int(tokens), self.config.max_num_batched_tokens))
        self.scheduler.step_token_budget = budget
        return budget

    # ---- stepping -------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Schedule and launch one step; return the outputs of the step before it (async
        scheduling, engine/pipeline.py) or of this one (synchronous steps)."""
        with self._using("step"):
            pipe, advance = self.pipeline, self._advance
            prev = pipe.expect()
            batch = self.scheduler.schedule()
            self.last_step_tokens = sum(batch.num_new_tokens)
            dropped = self.scheduler.finished_in_schedule
            cur = pipe.launch(batch, prev) if not batch.is_empty else None  # None: in flight
            outs = pipe.collect(prev, advance) if prev is not None else []
            outs += [self._overflowed(s) for s in dropped if self._is_live(s)]
            if cur is not None:
                outs += pipe.collect(cur, advance)
            return outs

    def _is_live(self, seq: Sequence) -> bool:
        live = self._live.get(seq.request_id)
        return live is not None and live.seq is seq

    def _overflowed(self, seq: Sequence) -> StepOutput:
        """A request the scheduler ended because it outgrew the whole KV cache."""
        live = self._drop(seq.request_id)
        return StepOutput(seq.request_id, [], live.stream.finish(), True, FinishReason.length,
                          seq.num_prompt_tokens, seq.num_output_tokens)

    def _advance(self, live: _Live, tok: int, lp: Any) -> StepOutput:
        """Output of ``tok``, already the last of ``live.seq.token_ids`` (pipeline.collect):
        stop checks, detokenization, finish."""
        seq, p = live.seq, live.seq.params
        toks = seq.token_ids
        n_out = len(toks) - seq.num_prompt_tokens
        plp = prompt_logprobs.entries(seq) if (p.prompt_logprobs is not None  # 1st output
                                                and n_out == seq.num_resumed_output + 1) else None
        if live.max_output == 0:  # max_tokens 0: the prompt scored (plp), no token output
            toks.pop()
            self.scheduler.finish(seq, FinishReason.length)  # a no-op if expect finished it
            seq.finish_reason = FinishReason.length
            self._drop(seq.request_id)
            return StepOutput(seq.request_id, [], "", True, FinishReason.length,
                              seq.num_prompt_tokens, 0, prompt_logprobs=plp)
        reason = None
        delta = ""
        by_string = False
        is_stop_token = tok in p.stop_token_ids or (tok in self.eos_token_ids and not p.ignore_eos)
        if is_stop_token and n_out >= p.min_tokens:
            reason = FinishReason.stop  # the stop token itself is not detokenized into the text
        else:
            delta, by_string = live.stream.push(tok)
            if by_string:
                reason = FinishReason.stop
            elif p.guided is not None and self.guided.advance(seq):
                reason = FinishReason.stop  # the grammar is complete: nothing but EOS may follow
            elif n_out >= live.max_output or len(toks) >= self.max_model_len:
                reason = FinishReason.length
        if reason is not None:
            if not by_string:  # release text held back as a possible stop-string prefix
                delta += live.stream.finish()
            self.scheduler.finish(seq, reason)  # a no-op if pipeline.expect finished it
            seq.finish_reason = reason
            self._drop(seq.request_id)
        return StepOutput(seq.request_id, [tok], delta, reason is not None, reason,
                          seq.num_prompt_tokens, n_out, [lp] if lp is not None else None, plp)


def _forget_frames(exc: BaseException) -> None:
    """Clear the locals of the frames a failed constructor's traceback (and the tracebacks
    it chains) hold: the model being built, a KV cache being sized, a step's activations.
    A caller may keep the exception (a notebook keeps the last one); its device memory
    must go now. The traceback's files and lines stay."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__
