"""The pure parts of bulk batches: JSONL line validation and mapping, output shaping, the
crash-safe files, the batch object's counts, the window syntax. No Redis, no workers."""
from __future__ import annotations

import json

import pytest

from pagedq.batch import files as F
from pagedq.batch.lines import (
    Line,
    LineError,
    Validator,
    job_id,
    parse,
    read_lines,
    request,
)
from pagedq.batch.record import Batch
from pagedq.batch.settings import window_seconds
from pagedq.batch.shape import invalid_line, outcome

B, M = "batch_x", "tiny"


def line(body=None, url="/v1/completions", **top) -> bytes:
    obj = {"custom_id": "c1", "method": "POST", "url": url,
           "body": body if body is not None else {"prompt": "hi"}, **top}
    return json.dumps(obj).encode() + b"\n"


def check(raw: bytes, n: int = 1) -> Line | LineError:
    return Validator(B, M).check(raw, n)


@pytest.mark.parametrize("raw, code", [
    (b"{nope\n", "invalid_json_line"),
    (b"[1, 2]\n", "invalid_json_line"),
    (b"\xff\xfe\n", "invalid_json_line"),
    (json.dumps({"method": "POST"}).encode(), "invalid_custom_id"),
    (line(custom_id=7), "invalid_custom_id"),
    (line(custom_id=""), "invalid_custom_id"),
    (line(method="GET"), "invalid_method"),
    (line(url="/v1/embeddings"), "invalid_url"),
    (line(extra=1), "invalid_json_line"),
    (line(body=[1]), "invalid_request"),
    (line({"prompt": "a", "model": "gpt-4o"}), "model_mismatch"),
    (line({"prompt": "a", "stream": True}), "invalid_request"),
    (line({"prompt": "a", "timeout_s": 5}), "invalid_request"),
    (line({"prompt": "a", "id": "x"}), "invalid_request"),
    (line({"prompt": "a", "lane": "interactive"}), "invalid_request"),
    (line({"prompt": ["a", "b"]}), "invalid_request"),
    (line({"messages": [{"role": "user", "content": "a"}]}), "invalid_request"),
    (line({"prompt": "a"}, url="/v1/chat/completions"), "invalid_request"),
    (line({"prompt": "a", "max_tokens": 0}), "invalid_request"),
    (line({"prompt": "a", "echo": "yes"}), "invalid_request"),
    (line({"prompt": "a", "prompt_logprobs": 1}), "invalid_request"),  # echo serves them
    (line({"prompt": ["a", "b"]}), "invalid_request"),  # one prompt per line
    (line({"prompt": "a", "best_of": 2}), "invalid_request"),
    (line({"prompt": "a", "suffix": "z"}), "invalid_request"),
    (line({"prompt": "a", "max_tokens": 5, "max_completion_tokens": 6}), "invalid_request"),
    (line({"prompt": "   "}), "invalid_request"),
    (line({}), "invalid_request"),
])
def test_invalid_lines_say_why_with_their_custom_id(raw, code):
    e = check(raw, 7)
    assert isinstance(e, LineError) and (e.line, e.code) == (7, code), e
    assert e.message
    row = invalid_line(e, B)
    assert row["response"] is None and row["error"]["line"] == 7
    assert row["id"] == f"batch_req_{B}.7"  # the id its job would have had
    if b"custom_id" in raw and code not in ("invalid_custom_id", "invalid_json_line"):
        assert row["custom_id"] == "c1"


def test_duplicate_custom_id_is_invalid_from_its_second_line_on():
    v = Validator(B, M)
    assert isinstance(v.check(line(), 1), Line)
    e = v.check(line({"prompt": "other"}), 2)
    assert isinstance(e, LineError) and e.code == "duplicate_custom_id" and e.custom_id == "c1"


def test_openai_bodies_map_onto_job_requests():
    chat = line({"messages": [{"role": "developer", "content": "be brief"},
                              {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                 "max_completion_tokens": 9, "logprobs": True, "top_logprobs": 3,
                 "user": "u1", "stop": None, "model": M, "stream": False},
                url="/v1/chat/completions")
    ln = check(chat, 4)
    assert ln == Line(4, "c1", "chat", True)
    req = request(parse(chat, 4, M), B, M, timeout_s=30.0)
    assert (req.id, req.lane, req.model, req.timeout_s) == (job_id(B, 4), "batch", M, 30.0)
    assert (req.max_tokens, req.logprobs, req.metadata, req.stop) == (9, 3, {"user": "u1"}, [])
    assert req.messages[0].role == "system" and req.messages[1].content == "hi"
    ids = line({"prompt": [[5, 6, 7]], "logprobs": 2, "n": 2, "seed": 3})
    req = request(parse(ids, 1, M), B, M)
    assert (req.prompt, req.logprobs, req.n, req.seed) == ([5, 6, 7], 2, 2, 3)
    assert request(parse(line({"prompt": ["one"]}), 1, M), B, M).prompt == "one"


def test_a_line_gives_the_same_body_every_time_but_for_timeout():
    raw = line({"prompt": "same", "temperature": 0.5, "stop": "x"})
    a = request(parse(raw, 3, M), B, M, timeout_s=10.0)
    b = request(parse(raw, 3, M), B, M, timeout_s=10.0)
    assert a.body_json() == b.body_json()


def test_read_lines_skips_blank_lines_and_gives_resumable_offsets(tmp_path):
    p = tmp_path / "in.jsonl"
    p.write_bytes(b"a\n\n  \nb\nc")
    with open(p, "rb") as f:
        got = list(read_lines(f))
    assert [(n, raw) for n, _, raw in got] == [(1, b"a\n"), (4, b"b\n"), (5, b"c")]
    with open(p, "rb") as f:  # resume after line 4, as the ingest does from its cursor
        f.seek(got[1][1])
        assert [(n, raw) for n, _, raw in read_lines(f, 5)] == [(5, b"c")]


def rec(**h) -> dict[str, str]:
    base = {"status": "finished", "finish_reason": "stop", "text": "hello",
            "prompt_tokens": "3", "completion_tokens": "2", "finished_at": "100.5"}
    return {**base, **{k: str(v) for k, v in h.items()}}


def test_outcomes_of_each_terminal_state():
    ln = Line(1, "c1", "completion", False)
    kw = dict(batch_cancelled=False, expires_at=200.0)
    ok, row, cut = outcome(ln, "j", rec(), M, **kw)
    body = row["response"]["body"]
    assert ok and not cut and row["error"] is None and row["response"]["status_code"] == 200
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "hello"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert body["created"] == 100 and row["response"]["request_id"] == "j"

    def code(h, **k):
        ok, row, cut = outcome(ln, "j", h, M, **{**kw, **k})
        assert not ok and row["response"] is None
        return row["error"]["code"], cut
    assert code(rec(finish_reason="deadline")) == ("batch_expired", True)
    assert code(rec(status="expired", finish_reason="deadline")) == ("batch_expired", False)
    assert code(rec(status="expired", finish_reason="no_worker")) == ("no_worker", False)
    assert code(rec(status="failed", error="boom")) == ("job_failed", False)
    assert code(rec(status="failed", error="boom", deadline=200)) == ("job_failed", False)
    assert code(rec(status="failed", error="late", deadline=100)) == ("batch_expired", False)
    slow = "prompt of 23 tokens needs about 1 s to prefill; the job's deadline allows 0 s"
    assert code(rec(status="expired", finish_reason="deadline", error=slow,
                    deadline=200)) == ("batch_expired", False)
    assert code(rec(status="cancelled"), batch_cancelled=True) == ("batch_cancelled", False)
    assert code(rec(status="cancelled", finished_at=250)) == ("batch_expired", False)
    assert code(rec(status="cancelled", finished_at=150)) == ("cancelled", False)
    assert code({}) == ("result_missing", False)


def test_chat_choices_and_logprobs_shapes():
    ln = Line(1, "c1", "chat", True)
    lp = [{"id": 1, "token": "h", "logprob": -0.5, "rank": 1,
           "top": [{"id": 1, "token": "h", "logprob": -0.5}]}]
    events = [{"t": "token", "i": "0", "d": "h", "ids": "1", "lp": json.dumps(lp)},
              {"t": "token", "i": "1", "d": "x", "ids": "2", "c": "1",
               "lp": json.dumps([{**lp[0], "token": "x"}])},
              {"t": "final", "i": "2"}]
    choices = [{"index": 0, "text": "h", "finish_reason": "length", "completion_tokens": 1},
               {"index": 1, "text": "x", "finish_reason": "stop", "completion_tokens": 1}]
    ok, row, _ = outcome(ln, "j", rec(choices=json.dumps(choices)), M, batch_cancelled=False,
                         expires_at=0, events=events)
    body = row["response"]["body"]
    assert body["object"] == "chat.completion" and len(body["choices"]) == 2
    c0, c1 = body["choices"]
    assert c0["message"] == {"role": "assistant", "content": "h"}
    assert (c0["finish_reason"], c1["finish_reason"]) == ("length", "stop")
    assert c0["logprobs"]["content"][0]["top_logprobs"][0]["token"] == "h"
    assert c1["logprobs"]["content"][0]["token"] == "x"
    trimmed = events[1:]  # the log no longer starts at event 0: no logprobs rather than some
    _, row, _ = outcome(ln, "j", rec(), M, batch_cancelled=False, expires_at=0, events=trimmed)
    assert row["response"]["body"]["choices"][0]["logprobs"] is None


def test_echo_and_openai_fields_that_change_nothing():
    raw = line({"prompt": "Hi", "echo": True, "logprobs": 1, "max_tokens": 0, "store": True,
                "service_tier": "auto", "metadata": {"team": "a"}, "best_of": 1, "suffix": ""})
    ln = check(raw, 2)
    assert ln == Line(2, "c1", "completion", True, False, True)
    assert Line.from_row(ln.row()) == ln and Line.from_row(ln.row()[:4]).echo is False
    req = request(parse(raw, 2, M), B, M)
    assert (req.prompt, req.max_tokens, req.prompt_logprobs, req.metadata) == \
        ("Hi", 0, 1, {"team": "a"})
    plp = [{"id": 7, "token": "H", "logprob": None, "rank": None, "top": []},
           {"id": 8, "token": "i", "logprob": -1.5, "rank": 2,
            "top": [{"id": 9, "token": "!", "logprob": -0.5}]}]
    events = [{"t": "token", "i": "0", "d": "", "ids": "", "pt": "2",
               "plp": json.dumps(plp)}, {"t": "final", "i": "1"}]
    ok, row, _ = outcome(ln, "j", rec(text="", completion_tokens=0), M, batch_cancelled=False,
                         expires_at=0, events=events)
    c = row["response"]["body"]["choices"][0]
    assert ok and c["text"] == "Hi"  # the prompt, as its tokens spell it
    assert c["logprobs"] == {"tokens": ["H", "i"], "token_logprobs": [None, -1.5],
                             "top_logprobs": [None, {"!": -0.5}], "text_offset": [0, 1]}


def test_append_cuts_a_partial_last_line_and_readers_skip_one(tmp_path):
    p = tmp_path / "out.jsonl"
    F.append_rows(p, [{"custom_id": "a"}])
    with open(p, "ab") as f:
        f.write(b'{"custom_id": "b", "trunc')  # a crash mid-write
    assert [r["custom_id"] for r in F.read_rows(p)] == ["a"]
    F.append_rows(p, [{"custom_id": "b"}, {"custom_id": "a"}])  # re-delivered after a crash
    assert [r["custom_id"] for r in F.read_rows(p)] == ["a", "b", "a"]
    assert [r["custom_id"] for r in F.unique_rows(F.read_rows(p))] == ["a", "b"]
    big = tmp_path / "big.jsonl"
    big.write_bytes(b'{"custom_id": "z"}\n' + b"x" * 200_000)  # a long partial line
    F.append_rows(big, [{"custom_id": "y"}])
    assert [r["custom_id"] for r in F.read_rows(big)] == ["z", "y"]
    assert list(F.read_rows(tmp_path / "missing.jsonl")) == []


def test_invalid_lines_are_keyed_by_line_not_custom_id():
    dup = {"custom_id": "a", "error": {"code": "duplicate_custom_id", "line": 9}}
    rows = [{"custom_id": "a", "error": None}, dup, dup]
    assert list(F.unique_rows(rows)) == rows[:2]


def test_copy_input_enforces_the_limits(tmp_path):
    from pagedq.wire.errors import InvalidRequest

    src = tmp_path / "in.jsonl"
    src.write_bytes(b"a\n\nb\n")
    assert F.copy_input(src, tmp_path / "c1", 100, 2)[:2] == (5, 2)
    with pytest.raises(InvalidRequest, match="lines"):
        F.copy_input(src, tmp_path / "c2", 100, 1)
    with pytest.raises(InvalidRequest, match="bytes"):
        F.copy_input(src, tmp_path / "c3", 3, 10)
    src.write_bytes(b"\n \n")
    with pytest.raises(InvalidRequest, match="no request lines"):
        F.copy_input(src, tmp_path / "c4", 100, 10)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c1", "in.jsonl"]


@pytest.mark.parametrize("w, s", [("24h", 86400), ("30s", 30), ("10m", 600), ("7d", 604800)])
def test_windows(w, s):
    assert window_seconds(w) == s


@pytest.mark.parametrize("w", ["", "24", "0h", "1y", "8d", "-1h", "1.5h"])
def test_bad_windows(w):
    with pytest.raises(ValueError):
        window_seconds(w)


def test_live_counts_move_cut_jobs_to_failed_and_final_counts_win():
    h = {"status": "in_progress", "validated": "1", "lines": "10", "invalid": "2",
         "completed": "5", "failed": "1", "cut": "1", "n_finished": "5", "n_failed": "1",
         "created_at": "100.9"}
    b = Batch.from_hash("b", h)
    assert b.request_counts.model_dump() == {"total": 10, "completed": 4, "failed": 4}
    assert b.jobs == {"finished": 5, "failed": 1} and b.created_at == 100 and not b.done
    b = Batch.from_hash("b", {**h, "status": "completed", "final_completed": "7",
                              "final_failed": "3"})
    assert b.request_counts.model_dump() == {"total": 10, "completed": 7, "failed": 3} and b.done
    assert Batch.from_hash("b", {"status": "validating"}).request_counts.total == 0
