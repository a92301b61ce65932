"""The GPU benches' CPU paths with the 8-bit KV caches, so that a GPU call runs them as they
are: bench/offline.py --smoke on the tiny model with each kv_cache_dtype, and
bench/attention.py --dry-run (the Triton interpreter, tiny shapes) timing each 8-bit cache
as the engine runs it. Their figures mean nothing here; what is checked is that every
dtype runs through and reports."""
from __future__ import annotations

import json
import os

import pytest

from tests.test_round3_bench import _bench


@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2", "int8"])
def test_offline_smoke_with_each_8bit_cache(kv, tmp_path):
    out = _bench("offline.py", "--smoke", "--shape", "tiny", "--device", "cpu", "--num-seqs",
                 "4", "--kv-cache-dtype", kv, "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(next(x for x in out.stdout.splitlines() if x.startswith("{")))
    assert res["kv_cache_dtype"] == kv and res["output_tokens"] == 4 * 16
    assert res["kv_cache"].startswith({"fp8": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2",
                                       "int8": "int8"}[kv])
    assert os.path.exists(tmp_path / f"offline-tiny-4-{kv}.json")


def test_offline_refuses_an_unknown_kv_cache_dtype():
    out = _bench("offline.py", "--smoke", "--kv-cache-dtype", "fp4")
    assert out.returncode == 2 and "invalid choice: 'fp4'" in out.stderr


def test_attention_dry_run_times_each_8bit_cache(tmp_path):
    out = _bench("attention.py", "--dry-run", "--quick", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    (path,) = tmp_path.glob("attention-*.json")
    rows = json.loads(path.read_text())["kv8"]
    assert [r["kind"] for r in rows] == ["fp8", "fp8_e5m2", "int8"]
    for r in rows:  # quantization error against the bf16 cache's output, nothing broken
        assert 0 < r["relerr_vs_bf16_cache"] < 0.15 and r["us"] > 0, r
    assert "8-bit caches as the engine runs them" in out.stdout
    bad = _bench("attention.py", "--dry-run", "--kv-dtypes", "fp8,int4")
    assert bad.returncode == 2 and "--kv-dtypes: int4 not one of" in bad.stderr


def test_kernel_report_compiles_for_sm90_without_a_gpu(tmp_path):
    """bench/kernel_report.py with the installed Triton (any machine): the store kernels of
    each 8-bit cache compile for sm_90 and report registers and their SASS."""
    out = _bench("kernel_report.py", "--cases", "store", "--json", str(tmp_path / "r.json"),
                 "--sass", str(tmp_path / "sass"))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads((tmp_path / "r.json").read_text())
    assert {"store_kvcache int8", "store_kvcache e5m2", "qk_norm_rope_store e4m3"} <= set(rows)
    for r in rows.values():
        assert 0 < r["registers"] <= 255 and r["sass"] > 0
    assert rows["store_kvcache e4m3"]["conversions"] > 0  # float -> e4m3
    assert len(list((tmp_path / "sass").glob("*.sass"))) == len(rows)
    bad = _bench("kernel_report.py", "--cases", "store,nope")
    assert bad.returncode == 2 and "--cases: nope not one of" in bad.stderr
