"""bench/redis_cost.py end to end at a tiny size: real redis-servers (one, then a 3-master
cluster), simulated workers on the real publish path, real clients reading every job."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench", "redis_cost.py")
TINY = ["--workers", "1", "--readers", "1", "--cluster-workers", "1", "--cluster-readers", "1",
        "--running", "8", "--max-tokens", "12", "--tokens-per-event", "2", "--warmup", "0.2",
        "--duration", "1", "--partitions", "3"]


def _bench(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, BENCH, *args], capture_output=True, text=True,
                          timeout=240, cwd=ROOT)


@pytest.mark.parametrize("target", ["single", "cluster"])
def test_bench_runs_and_counts_agree(tmp_path, target):
    out = _bench(tmp_path, "--target", target, *TINY, "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.load(open(tmp_path / "redis-cost.json"))["results"][target]
    t = res["totals"]
    # every job was read to its end, each with all its tokens, and nothing else was read
    assert t["jobs_read"] > 0 and t["jobs_bad"] == 0
    assert t["tokens_read"] == t["tokens_written"] == t["jobs_read"] * 12
    assert t["events_written"] == t["jobs_read"] * 6  # 12 tokens, 2 per event
    assert res["tokens"] > 0 and res["events"] > 0 and res["redis_cpu_s"] > 0
    assert res["mean_tokens_per_event"] == 2.0
    assert res["cpu_s_per_million_tokens"] > 0 and res["derived_workers_per_redis_core"] > 0
    assert sum(res["partitions_per_master"]) == (3 if target == "cluster" else 1)
    assert "derived: one fully busy Redis core serves about" in out.stdout


def test_bad_input_is_one_line(tmp_path):
    out = _bench(tmp_path, "--running", "0")
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "--running" in out.stderr
    out = _bench(tmp_path, "--masters", "3", "--partitions", "2")
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0
