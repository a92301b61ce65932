"""Guided decoding in the engine: a grammar matcher per guided sequence (llguidance), and
the token bitmasks of a step's guided rows.

Each guided Sequence has one ``LLMatcher`` that has consumed its first ``consumed`` output
tokens. Invariants:
  * consumed <= num_output_tokens, and the matcher's state is exactly that of those
    tokens: ``advance`` consumes the tokens the host knows past them (and, in a launch,
    the value of a placeholder the pipeline read off the step in flight), never one twice;
  * a row's mask for the next token is built from a matcher that has consumed every
    token before it; the sampler sets every token outside it to -inf (engine/sampler.py);
  * a matcher is dropped with its sequence (finished, aborted); preemption keeps it (the
    sequence keeps its tokens).
A crash-resumed request's already-streamed tokens go through its matcher at add_request
(``start``): tokens the grammar refuses are a ValueError there.

Grammars are compiled once per spec: ``GrammarCache`` keeps a matcher in its start state
per spec (LRU, bounded, thread-safe) and hands out copies (microseconds; compiling is
about a millisecond, docs/benchmarks.md). The llguidance tokenizer is built by the first
guided request, or ``prepare()`` (about half a second for a 49k vocabulary), never for an
unguided engine.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from pagedq.engine.sequence import Sequence
from pagedq.wire.guided import GuidedSpec, grammar_of, library, one_line

CACHE_SIZE = 64  # compiled grammars kept (~0.3 MB each with a matcher stepped: the bench)
log = logging.getLogger(__name__)


class GrammarCache:
    """spec -> a compiled matcher in its start state, least recently used dropped past
    ``capacity``; ``matcher(spec)`` returns a fresh copy. Safe to share between threads."""

    def __init__(self, tokenizer: Any, capacity: int = CACHE_SIZE) -> None:
        if capacity < 1:
            raise ValueError("the grammar cache holds at least 1 grammar")
        self.tokenizer, self.capacity = tokenizer, capacity
        self._lock = threading.Lock()
        self._start: OrderedDict[GuidedSpec, Any] = OrderedDict()
        self.hits = self.compiles = 0

    def __len__(self) -> int:
        return len(self._start)

    def matcher(self, spec: GuidedSpec) -> Any:
        with self._lock:
            start = self._start.get(spec)
            if start is not None:
                self._start.move_to_end(spec)
                self.hits += 1
                return start.deep_copy()
        start = self._compile(spec)  # outside the lock: a compile holds up no other thread
        with self._lock:
            self.compiles += 1
            self._start[spec] = start
            self._start.move_to_end(spec)
            while len(self._start) > self.capacity:
                self._start.popitem(last=False)
            return start.deep_copy()

    def _compile(self, spec: GuidedSpec) -> Any:
        m = library().LLMatcher(self.tokenizer, grammar_of(spec), log_level=0)
        if m.is_error():
            raise ValueError(f"guided {spec.kind}: {one_line(m.get_error())}")
        return m


@dataclass(slots=True, eq=False)
class _Guided:
    matcher: Any
    kind: str
    consumed: int = 0  # output tokens the matcher has consumed


@dataclass(slots=True)
class GuidedMask:
    """The token masks of one step's guided rows, for the sampler."""

    rows: list[int]  # positions of the guided rows among the step's sampling rows
    bitmask: torch.Tensor  # int32 [len(rows), ceil(V / 32)] on the host (pinned for CUDA)


class GuidedDecoding:
    """The matchers of an engine's guided sequences (module doc). ``tokenizer`` is the
    model's Hugging Face tokenizer (a fast one), or None (guided requests are refused)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: set[int],
                 pin_memory: bool = False, cache_size: int = CACHE_SIZE) -> None:
        self._hf, self.vocab_size = tokenizer, vocab_size
        # the EOS a grammar allows where it may end: the tokenizer's own if the engine
        # stops on it (the engine stops on any of its EOS ids; older llguidance takes one)
        own = getattr(tokenizer, "eos_token_id", None)
        self._eos = own if own in eos_token_ids else min(eos_token_ids, default=None)
        self.pin_memory, self.cache_size = pin_memory, cache_size
        self.words = (vocab_size + 31) // 32
        self.cache: GrammarCache | None = None
        self._executor: Any = None
        self._rows: dict[Sequence, _Guided] = {}
        self.mask_s = 0.0  # host time spent advancing matchers and filling masks (stats)

    def __bool__(self) -> bool:
        return bool(self._rows)

    def __contains__(self, seq: Sequence) -> bool:
        return seq in self._rows

    def prepare(self) -> GrammarCache:
        """Build the llguidance tokenizer and the grammar cache now (the first guided request
        does otherwise, on the engine thread: ~0.5 s for a 49k vocabulary); ValueError if
        this model cannot be guided."""
        if self.cache is None:
            if self._hf is None or not hasattr(self._hf, "backend_tokenizer"):
                raise ValueError("guided decoding needs the model's fast (tokenizers) "
                                 "tokenizer; this model has none")
            lib = library()
            try:
                tok = lib.LLTokenizer(self._hf.backend_tokenizer.to_str(),
                                      n_vocab=self.vocab_size, eos_token=self._eos)
            except Exception as e:  # noqa: BLE001  (the library's own error types)
                raise ValueError(f"guided decoding: the tokenizer does not fit the model's "
                                 f"{self.vocab_size}-token vocabulary ({one_line(str(e))})") from None
            self._executor = lib.LLExecutor()
            self.cache = GrammarCache(tok, self.cache_size)
        return self.cache

    def start(self, spec: GuidedSpec, resumed: list[int]) -> _Guided:
        """A matcher of ``spec`` that has consumed ``resumed`` (a crash resume's streamed
        tokens); ValueError if the spec does not compile or the grammar refuses them."""
        matcher = self.prepare().matcher(spec)
        if resumed and not matcher.consume_tokens(resumed):
            raise ValueError(f"guided {spec.kind}: the resumed tokens do not follow the "
                             f"grammar ({one_line(matcher.get_error())})")
        return _Guided(matcher, spec.kind, len(resumed))

    def attach(self, seq: Sequence, state: _Guided, copy: bool) -> None:
        """Guide ``seq`` from ``state`` (``start``'s), or from a copy of it (n > 1)."""
        if copy:
            state = _Guided(state.matcher.deep_copy(), state.kind, state.consumed)
        self._rows[seq] = state

    def drop(self, seq: Sequence) -> None:
        self._rows.pop(seq, None)

    def advance(self, seq: Sequence, pending: int | None = None) -> bool:
        """Consume seq's tokens that its matcher has not; ``pending`` is the value of its
        last token when that is still a placeholder (engine/pipeline.py reads it off the
        step in flight). True once the grammar is finished: nothing but EOS may follow, or
        it refused a token (logged: the mask should have made that impossible)."""
        g = self._rows[seq]
        toks = seq.token_ids
        new = toks[seq.num_prompt_tokens + g.consumed:len(toks) - (pending is not None)].tolist()
        if pending is not None:
            new.append(pending)
        if new:
            g.consumed += len(new)
            if not g.matcher.consume_tokens(new) and g.matcher.is_error():
                log.warning("guided %s: request %s: %s", g.kind, seq.request_id,
                            one_line(g.matcher.get_error()))
        return g.matcher.is_stopped()

    def masks(self, seqs: list[Sequence], pending: dict[Sequence, int]) -> GuidedMask | None:
        """The masks of the guided rows among a step's sampling rows ``seqs`` (None if
        none), each matcher first advanced to the row's last token (``pending``: the
        values of placeholders, from the step in flight). Filled by llguidance's thread
        pool, outside the GIL."""
        rows = [j for j, s in enumerate(seqs) if s in self._rows]
        if not rows:
            return None
        t0 = time.perf_counter()
        for j in rows:
            self.advance(seqs[j], pending.get(seqs[j]))
        mask = torch.empty((len(rows), self.words), dtype=torch.int32,
                           pin_memory=self.pin_memory)
        self._executor.unsafe_compute_mask_ptr(
            [(self._rows[seqs[j]].matcher, g) for g, j in enumerate(rows)], mask.data_ptr(),
            self.words * 4, len(rows))
        self.mask_s += time.perf_counter() - t0
        return GuidedMask(rows, mask)
