"""worker/metrics.py: observe_many records what as many observe() calls would."""
from __future__ import annotations

import gc

from prometheus_client import CollectorRegistry, Histogram

from pagedq.worker.gc_pauses import GcPauses
from pagedq.worker.metrics import observe_many

BUCKETS = (0.001, 0.005, 0.01, 0.1)


def samples(hist: Histogram) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in hist.collect() for s in family.samples
            if not s.name.endswith("_created")}


def test_observe_many_equals_repeated_observe():
    one = Histogram("one", "d", buckets=BUCKETS, registry=CollectorRegistry())
    many = Histogram("many", "d", buckets=BUCKETS, registry=CollectorRegistry())
    # on a bound, between bounds, past the last bound (+Inf), and a count of one
    for amount, count in ((0.005, 3), (0.007, 5), (2.0, 4), (0.0001, 1)):
        for _ in range(count):
            one.observe(amount)
        observe_many(many, amount, count)
    got = {(name.replace("many", "one"), labels): v for (name, labels), v in
           samples(many).items()}
    assert got == samples(one)


def test_gc_pauses_freezes_the_heap_and_times_full_collections_only():
    pauses = GcPauses()
    held = [[i] for i in range(1000)]  # tracked objects alive at start-up
    pauses.start()
    try:
        assert gc.get_freeze_count() >= len(held)
        gc.collect(1)  # a younger generation: not counted
        assert pauses.full == 0
        gc.collect()
        gc.collect()
        assert pauses.full == 2 and 0 < pauses.max_s <= pauses.total_s
    finally:
        pauses.stop()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert pauses.full == 2  # stopped: no longer counted
