"""bench/shared_prefix.py end to end at a tiny size on the CPU (the tiny model), and the
one-line refusals of bench/round3.py and bench/offline.py --decode-variant. (bench/round3.py
--smoke runs the whole GPU script on the CPU: minutes under the interpreter, not run here.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench(script: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, os.path.join(ROOT, "bench", script), *args],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)


def test_shared_prefix_hits_and_counts():
    out = _bench("shared_prefix.py", "--smoke", "--ab")
    assert out.returncode == 0, out.stderr[-3000:]
    runs = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    assert [r["switch"] for r in runs] == [
        "caching on", "piecewise off", "prefill_wait_steps 0", "chunked prefill off",
        "caching off", "caching on", "caching on/suffix 16", "piecewise off/suffix 16"]
    for r in runs:  # smoke: 8 requests, a 64-token prefix, 8-token suffixes, 8 tokens out
        assert r["output_tokens"] == 8 * 8 and r["steps"] >= 8
        cached, sfx = r["switch"] != "caching off", r["suffix_len"]
        # every request after the first hits the whole prefix (it is a multiple of the block)
        assert r["prefix_hit_tokens"] == (7 * 64 if cached else 0)
        assert r["first_step_tokens"][0] == (64 + 8 * sfx if cached else 8 * (64 + sfx))
    assert {r["suffix_len"] for r in runs} == {8, 16}
    assert "tok/s" in out.stdout


@pytest.mark.parametrize("args,message", [
    (["--variants", "fp8=nope"], "decode variant 'nope'"),
    (["--variants", "int8=tile"], "is not KIND=VARIANT"),
    (["--e2e", "swap8:w=zero"], "bad knob"),
])
def test_round3_refuses_bad_variants(args, message):
    out = _bench("round3.py", *args)
    assert out.returncode == 2 and message in out.stderr, out.stderr[-2000:]


def test_offline_refuses_a_bad_decode_variant():
    out = _bench("offline.py", "--decode-variant", "swap8:bn=x", "--shape", "tiny",
                 "--device", "cpu")
    assert out.returncode == 2 and "--decode-variant: decode variant" in out.stderr
