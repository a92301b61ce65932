"""The sans-IO reading protocol (producer/reader.py) on its own: no Redis, the replies are
fed by hand and each command the protocol asks for is checked."""
from __future__ import annotations

import json
from typing import Any

import pytest

from pagedq.producer.reader import (
    POLL_S,
    READ_COUNT,
    Backoff,
    Command,
    Exchange,
    Exists,
    GetMessage,
    HGetAll,
    JobHead,
    LastEntry,
    Subscribe,
    TextDeltas,
    XRead,
    read_mirror,
    read_status,
    read_stream,
    wait_result,
)
from pagedq.wire.errors import EventsTrimmed, JobNotFound, ResultTimeout
from pagedq.wire.events import ChoiceReplay, entries_of, replay
from pagedq.wire.keys import Keys, out_entry_id
from pagedq.wire.schema import FinalEvent, JobRecord, TokenEvent, final_fields, token_fields

KEYS = Keys("t")
JOB, OUT = KEYS.job("j"), KEYS.out("j")
RUNNING = {"status": "running", "model": "m"}
DONE = {"status": "finished", "model": "m", "text": "abc", "error": "", "finish_reason": "stop"}


class Clock:
    """A hand-moved monotonic clock."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def xread_reply(*indices: int, final_at: int | None = None) -> list[Any]:
    """An XREAD reply (RESP2 shape) holding the given event indices; ``final_at``: that
    index is the final event, the others tokens."""
    entries = [(out_entry_id(i), final_fields(i, "finished", "stop", "abc", "", 1, i)
                if i == final_at else token_fields(i, "abc"[i % 3], [i])) for i in indices]
    return [[OUT, entries]] if entries else []


def last_entry(index: int, final: bool) -> list[Any]:
    fields = (final_fields(index, "finished", "stop", "abc", "", 1, index) if final
              else token_fields(index, "x", [index]))
    return [(out_entry_id(index), fields)]


def play(proto, script: list[tuple[Command, Any]]) -> tuple[list[Any], Any]:
    """Step ``proto`` as a shell would, checking that it asks for the script's commands in
    order and answering each with its reply. Returns (events, the protocol's value); the
    script must be used up."""
    run, events, todo = Exchange(proto), [], list(script)
    for step in run:
        if isinstance(step, Command):
            assert todo, f"unexpected command {step}"
            want, reply = todo.pop(0)
            assert step == want
            run.reply = reply
        else:
            events.append(step)
    assert not todo, f"commands never asked for: {todo}"
    return events, run.value


# ---------------------------------------------------------------- stream

def test_stream_reads_every_event_once_then_stops_at_the_final():
    events, value = play(read_stream(KEYS, "j"), [
        (Exists(JOB), 1),
        (XRead(OUT, "0-0", READ_COUNT, None), xread_reply(0, 1)),
        (XRead(OUT, "0-2", READ_COUNT, None), xread_reply(2, 3, final_at=3)),
    ])
    assert [e.index for e in events] == [0, 1, 2, 3] and value is None
    assert all(isinstance(e, TokenEvent) for e in events[:3])
    assert isinstance(events[3], FinalEvent) and events[3].text == "abc"


def test_stream_resumes_from_a_cursor():
    events, _ = play(read_stream(KEYS, "j", from_index=5), [
        (Exists(JOB), 1),
        (XRead(OUT, "0-5", READ_COUNT, None), xread_reply(5, 6)),
        (XRead(OUT, "0-7", READ_COUNT, None), xread_reply(7, final_at=7)),
    ])
    assert [e.index for e in events] == [5, 6, 7]


def test_stream_blocks_when_idle_and_times_out_on_its_clock():
    clock = Clock()
    proto = read_stream(KEYS, "j", timeout=12.0, clock=clock)
    run = Exchange(proto)
    assert next(run) == Exists(JOB)
    run.reply = 1
    assert next(run) == XRead(OUT, "0-0", READ_COUNT, None)  # the first read never blocks
    run.reply = []
    assert next(run) == HGetAll(JOB)
    run.reply = RUNNING
    assert next(run) == XRead(OUT, "0-0", READ_COUNT, int(POLL_S * 1000))  # capped at POLL_S
    clock.now += 9.0
    run.reply = []
    assert next(run) == HGetAll(JOB)
    run.reply = RUNNING
    assert next(run) == XRead(OUT, "0-0", READ_COUNT, 3000)  # what is left of the timeout
    clock.now += 3.0
    run.reply = []
    assert next(run) == HGetAll(JOB)
    run.reply = RUNNING
    with pytest.raises(ResultTimeout, match="no event of job 'j' for 12.0 s"):
        next(run)


def test_trimmed_log_while_running_raises_events_trimmed():
    with pytest.raises(EventsTrimmed, match="from index 0"):
        play(read_stream(KEYS, "j"), [
            (Exists(JOB), 1),
            (XRead(OUT, "0-0", READ_COUNT, None), xread_reply(2, 3)),  # 0 and 1 trimmed
            (HGetAll(JOB), RUNNING),
        ])


def test_trim_inside_a_batch_yields_the_events_before_it_first():
    run = Exchange(read_stream(KEYS, "j"))
    assert next(run) == Exists(JOB)
    run.reply = 1
    assert next(run) == XRead(OUT, "0-0", READ_COUNT, None)
    run.reply = xread_reply(0, 1, 4)  # 2 and 3 trimmed
    assert [next(run).index, next(run).index] == [0, 1]
    assert next(run) == HGetAll(JOB)
    run.reply = RUNNING
    with pytest.raises(EventsTrimmed, match="from index 2"):
        next(run)


def test_terminal_hash_without_a_final_event_rebuilds_it_from_the_hash():
    """The log expired (or was never written) while the hash is terminal: after one more
    read, the final event is rebuilt from the hash at the cursor."""
    events, _ = play(read_stream(KEYS, "j"), [
        (Exists(JOB), 1),
        (XRead(OUT, "0-0", READ_COUNT, None), []),
        (HGetAll(JOB), DONE),
        (XRead(OUT, "0-0", READ_COUNT, None), []),  # re-read: it may just have landed
        (HGetAll(JOB), DONE),
        (LastEntry(OUT), []),
    ])
    (fin,) = events
    assert isinstance(fin, FinalEvent)
    assert (fin.index, fin.status, fin.text, fin.finish_reason) == (0, "finished", "abc", "stop")


def test_terminal_after_trimmed_tokens_rebuilds_the_final_at_the_cursor():
    events, _ = play(read_stream(KEYS, "j", from_index=1), [
        (Exists(JOB), 1),
        (XRead(OUT, "0-1", READ_COUNT, None), xread_reply(3)),  # 1 and 2 trimmed
        (HGetAll(JOB), DONE),
        (LastEntry(OUT), last_entry(3, final=False)),  # no final event in the log
    ])
    (fin,) = events
    assert isinstance(fin, FinalEvent) and fin.index == 1 and fin.text == "abc"


def test_terminal_takes_the_final_from_the_log_tail():
    events, _ = play(read_stream(KEYS, "j"), [
        (Exists(JOB), 1),
        (XRead(OUT, "0-0", READ_COUNT, None), xread_reply(4)),
        (HGetAll(JOB), DONE),
        (LastEntry(OUT), last_entry(4, final=True)),
    ])
    assert [(type(e), e.index) for e in events] == [(FinalEvent, 4)]


def test_stream_of_a_missing_or_vanished_job():
    with pytest.raises(JobNotFound):
        play(read_stream(KEYS, "j"), [(Exists(JOB), 0)])
    with pytest.raises(JobNotFound):
        play(read_stream(KEYS, "j"), [
            (Exists(JOB), 1), (XRead(OUT, "0-0", READ_COUNT, None), []), (HGetAll(JOB), {}),
        ])
    with pytest.raises(ValueError):
        next(read_stream(KEYS, "j", from_index=-1))


# ---------------------------------------------------------------- status / result

def test_status():
    _, rec = play(read_status(KEYS, "j"), [(HGetAll(JOB), RUNNING)])
    assert isinstance(rec, JobRecord) and rec.status == "running"
    with pytest.raises(JobNotFound):
        play(read_status(KEYS, "j"), [(HGetAll(JOB), {})])


def test_result_waits_past_the_log_tail_until_a_final_event():
    clock = Clock()
    _, rec = play(wait_result(KEYS, "j", timeout=60.0, clock=clock), [
        (JobHead(JOB, OUT), [last_entry(1, final=False), RUNNING]),
        (XRead(OUT, out_entry_id(1), READ_COUNT, int(POLL_S * 1000)), xread_reply(2)),
        (XRead(OUT, out_entry_id(2), READ_COUNT, int(POLL_S * 1000)),
         xread_reply(3, final_at=3)),
        (JobHead(JOB, OUT), [last_entry(3, final=True), DONE]),
    ])
    assert rec.status == "finished" and rec.text == "abc"


def test_result_times_out_on_its_clock():
    clock = Clock()
    run = Exchange(wait_result(KEYS, "j", timeout=1.5, clock=clock))
    assert next(run) == JobHead(JOB, OUT)
    run.reply = [[], RUNNING]
    assert next(run) == XRead(OUT, "0-0", READ_COUNT, 1500)
    clock.now += 1.5
    run.reply = []
    assert next(run) == JobHead(JOB, OUT)  # poll over: the hash is re-read first
    run.reply = [[], RUNNING]
    with pytest.raises(ResultTimeout, match="not done after 1.5 s"):
        next(run)


# ---------------------------------------------------------------- subscribe

def test_subscribe_to_an_ended_job_gives_its_final_event():
    events, _ = play(read_mirror(KEYS, "j"), [
        (Subscribe(KEYS.chan("j")), None),
        (HGetAll(JOB), DONE),
        (LastEntry(OUT), []),
    ])
    assert [(type(e), e.index, e.text) for e in events] == [(FinalEvent, 0, "abc")]


def test_subscribe_passes_messages_until_the_final():
    def msg(fields: dict[str, str]) -> dict[str, Any]:
        return {"type": "message", "data": json.dumps(fields)}
    events, _ = play(read_mirror(KEYS, "j", timeout=2.0, clock=Clock()), [
        (Subscribe(KEYS.chan("j")), None),
        (HGetAll(JOB), RUNNING),
        (GetMessage(2.0), None),
        (GetMessage(2.0), msg(token_fields(0, "a", [0]))),
        (GetMessage(2.0), msg(final_fields(1, "finished", "stop", "a", "", 1, 1))),
    ])
    assert [e.index for e in events] == [0, 1] and isinstance(events[1], FinalEvent)


# ---------------------------------------------------------------- helpers

def test_entries_of_both_reply_shapes():
    entries = [("0-1", token_fields(0, "a", [0]))]
    assert entries_of([[OUT, entries]]) == entries  # RESP2
    assert entries_of({OUT: [entries]}) == entries  # RESP3
    assert entries_of([]) == [] and entries_of(None) == []


def test_text_deltas_end_with_the_unstreamed_rest_of_the_final_text():
    cut = TextDeltas()
    evs = [TokenEvent(index=0, delta="ab"), TokenEvent(index=1, delta=""),
           FinalEvent(index=2, status="finished", text="abcd")]
    assert [cut(e) for e in evs] == ["ab", "", "cd"]
    assert TextDeltas()(FinalEvent(index=0, status="finished", text="")) == ""


def test_backoff_delay_after_raises_the_failure_once_spent():
    err = ConnectionError("down")
    assert 0 < Backoff(10.0).delay_after(err) <= 0.05
    with pytest.raises(ConnectionError) as got:
        Backoff(0.0).delay_after(err)
    assert got.value is err


def test_replay_folds_published_tokens_per_choice_and_stops_at_the_first_unusable_event():
    def tok(i, c, d, ids, fr=None):
        return (f"0-{i + 1}", token_fields(i, d, ids, choice=c, finish_reason=fr))

    log = [tok(0, 0, "a", [1]), tok(1, 1, "b", [2]), tok(2, 0, "c", [3, 4], "length"),
           tok(3, 1, "d", [5])]
    choices, nxt = replay(log, 2)
    assert nxt == 4
    assert [c.token_ids for c in choices] == [[1, 3, 4], [2, 5]]
    assert ["".join(c.deltas) for c in choices] == ["ac", "bd"]
    assert [c.finish_reason for c in choices] == ["length", None]
    # a gap (trimmed or lost entry), a choice out of range, a final, garbage: stop there
    assert replay([log[0], log[2]], 2)[1] == 1
    assert replay(log, 1)[1] == 1
    final = ("0-2", final_fields(1, "finished", "stop", "a", "", 1, 1))
    assert replay([log[0], final], 2)[1] == 1
    assert replay([log[0], ("0-2", {"t": "token", "i": "x"})], 2)[1] == 1
    assert replay([], 3) == ([ChoiceReplay(), ChoiceReplay(), ChoiceReplay()], 0)
