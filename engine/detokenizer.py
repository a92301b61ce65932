"""Incremental detokenization and stop strings (vLLM / HF TextStreamer style).

IncrementalDetokenizer keeps a small window of ids: ``window[:read]`` is already emitted and
serves as context (so spaces and merges decode as in the full sequence), ``window[read:]`` is
pending. Each token costs one decode of the window (plus one per emission unless the decoder
is concatenative, i.e. ByteLevel); text is emitted only when the decode grew and does not end
in U+FFFD (a multi-byte character split across tokens). Invariant: concatenated ``add()`` results + ``flush()`` == ``decode(output ids,
skip_special_tokens)`` for byte-level BPE tokenizers (SmolLM, Llama 3, Qwen); Metaspace
tokenizers keep the first token's leading space, as vLLM does, because the prompt tail is the
initial context. After ``_MAX_PENDING`` tokens that never form valid UTF-8 the window is cut at
a clean token boundary (cost stays O(1) per token); only a stream with no clean boundary at all
(pure garbage bytes) can then decode differently from the full decode.

StopChecker holds back the longest suffix of the text that is still a proper prefix of some
stop string; everything before it can never become part of a match, so emitted text never
contains (a part of) a stop string that later completes.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

from pagedq.engine.sampling_params import SamplingParams

_CONTEXT = 5  # prompt tokens used as initial context (vLLM's initial detokenization offset)
_MAX_PENDING = 8  # > the 4 bytes of any UTF-8 character, even with one byte per token
_REPLACEMENT = "\ufffd"


@dataclass(slots=True, frozen=True)
class _TokInfo:
    decode: Callable[..., str]  # decode(ids, skip_special_tokens)
    special_ids: frozenset[int]
    # decode(a + b) == decode(a) + decode(b) when a ends on a character boundary (ByteLevel)
    concat: bool


# per tokenizer; a fallback bound decode keeps its tokenizer alive (tokenizers live long)
_INFO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _tok_info(tokenizer) -> _TokInfo:
    info = _INFO.get(tokenizer)
    if info is None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
            # the Rust decoder directly: same text, ~6x less Python overhead per call
            decode = backend.decode
            concat = type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"
        else:
            decode, concat = tokenizer.decode, False
        special = set(getattr(tokenizer, "all_special_ids", ()))
        for tid, tok in getattr(tokenizer, "added_tokens_decoder", {}).items():
            if getattr(tok, "special", False):
                special.add(tid)
        info = _TokInfo(decode, frozenset(special), concat)
        _INFO[tokenizer] = info
    return info


@dataclass(slots=True, init=False, eq=False, repr=False)
class _Emitted:
    """All text emitted so far, kept as pieces and joined lazily (push stays O(1))."""

    _pieces: list[str]

    @property
    def text(self) -> str:
        joined = "".join(self._pieces)
        self._pieces = [joined] if joined else []
        return joined


class IncrementalDetokenizer(_Emitted):
    _decode: Callable[..., str]
    _concat: bool
    _skip: bool
    _special: frozenset[int]
    _window: list[int]  # [:read] emitted (context), [read:] pending
    _read: int
    _prefix_text: str  # decode(window[:read])
    _pieces: list[str]

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        info = _tok_info(tokenizer)
        self._decode, self._concat = info.decode, info.concat
        self._skip = skip_special_tokens
        self._special = info.special_ids if skip_special_tokens else frozenset()
        ctx = [t for t in prompt_token_ids[-2 * _CONTEXT:] if t not in self._special][-_CONTEXT:]
        text = self._decode(ctx, self._skip) if ctx else ""
        if text.endswith(_REPLACEMENT):  # prompt cut inside a character: no usable context
            ctx, text = [], ""
        self._window, self._read, self._prefix_text = ctx, len(ctx), text
        self._pieces = []

    def add(self, token_id: int) -> str:
        """Feed one output token; returns the newly stable text (often "")."""
        if token_id in self._special:
            return ""  # skipped entirely, so runs of specials never grow the window
        w = self._window
        w.append(token_id)
        text = self._decode(w, self._skip)
        if len(text) > len(self._prefix_text) and not text.endswith(_REPLACEMENT):
            return self._emit(text, len(w))
        if len(w) - self._read < _MAX_PENDING:
            return ""
        return self._emit_invalid(text)

    def _emit_invalid(self, text: str) -> str:
        """Pending bytes that never became valid UTF-8: emit up to a clean token boundary c.

        A character that may still complete starts within the last 3 tokens (it has <= 3 of
        its bytes so far), so any c <= len - 3 where decoding splits cleanly is final.
        """
        w, d, skip = self._window, self._decode, self._skip
        for c in range(len(w) - 3, self._read, -1):
            head = d(w[:c], skip)
            if head.startswith(self._prefix_text) and head + d(w[c:], skip) == text:
                return self._emit(head, c)
        delta = self._emit(text, len(w))  # no clean boundary: a garbage byte stream
        self._window, self._read, self._prefix_text = [], 0, ""
        return delta

    def flush(self) -> str:
        """Emit whatever is pending (a sequence that ends inside a character)."""
        delta = ""
        if len(self._window) > self._read:
            delta = self._emit(self._decode(self._window, self._skip), len(self._window))
        self._window, self._read, self._prefix_text = [], 0, ""
        return delta

    def _emit(self, text: str, upto: int) -> str:
        """``text`` = decode(window[:upto]) is final; window[read:upto] becomes the context."""
        delta = text[len(self._prefix_text):]
        w = self._window[self._read:]
        self._read = upto - self._read
        self._window = w
        # window[:read] ends at a clean split (see _emit_invalid), so with a concatenative
        # decoder the new context decodes to exactly the delta
        self._prefix_text = delta if self._concat else self._decode(w[: self._read], self._skip)
        if delta:
            self._pieces.append(delta)
        return delta



@dataclass(slots=True, init=False, eq=False)
class StopChecker:
    _stops: tuple[str, ...]
    _chars: frozenset[str]
    _max_len: int
    _held: str  # the longest suffix that is a proper prefix of some stop string
    stopped: bool

    def __init__(self, stop: list[str]) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(dict.fromkeys(stop))
        self._chars = frozenset("".join(self._stops))
        self._max_len = max((len(s) for s in self._stops), default=0)
        self._held = ""
        self.stopped = False

    def push(self, text_delta: str) -> tuple[str, bool]:
        """Returns (text safe to emit now, whether a stop string matched)."""
        if self.stopped:
            return "", True
        if not self._stops or (not self._held and self._chars.isdisjoint(text_delta)):
            return text_delta, False  # no stop string can touch this text
        s = self._held + text_delta
        # no match can start before the held text, so searching s is complete. Generation
        # stops where a stop string first completes (earliest end, then longest), whatever
        # the chunking: find() gives each string's earliest start, hence its earliest end.
        best: tuple[int, int] | None = None
        for t in self._stops:
            i = s.find(t)
            if i >= 0 and (best is None or (i + len(t), i) < best):
                best = (i + len(t), i)
        if best is not None:
            self.stopped, self._held = True, ""
            return s[: best[1]], True
        cut = len(s)
        if s and s[-1] in self._chars:  # any held suffix contains the last character
            for i in range(max(0, len(s) - self._max_len + 1), len(s)):
                tail = s[i:]
                if any(t.startswith(tail) for t in self._stops):
                    cut = i
                    break
        self._held = s[cut:]
        return s[:cut], False

    def flush(self) -> str:
        """Release held-back text (the sequence finished for another reason)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held


@dataclass(slots=True, init=False, eq=False, repr=False)
class OutputStream(_Emitted):
    """Detokenizer + stop strings of one sequence; ``text`` == concatenation of all deltas."""

    _detok: IncrementalDetokenizer
    _stop: StopChecker
    _pieces: list[str]
    _finished: bool

    def __init__(self, tokenizer, params: SamplingParams, prompt_token_ids: list[int]) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens=True)
        self._stop = StopChecker(params.stop)
        self._pieces = []
        self._finished = False

    @property
    def stopped(self) -> bool:
        return self._stop.stopped

    def push(self, token_id: int) -> tuple[str, bool]:
        """Feed one sampled token; returns (delta to publish, stopped by a stop string)."""
        if self._stop.stopped or self._finished:
            return "", self._stop.stopped
        delta = self._detok.add(token_id)
        if not delta:
            return "", False
        out, stopped = self._stop.push(delta)
        if out:
            self._pieces.append(out)
        return out, stopped

    def finish(self) -> str:
        """Last delta when the sequence ends for another reason (EOS, max_tokens, abort)."""
        if self._stop.stopped or self._finished:
            return ""
        self._finished = True
        out, stopped = self._stop.push(self._detok.flush())
        if not stopped:
            out += self._stop.flush()
        if out:
            self._pieces.append(out)
        return out

