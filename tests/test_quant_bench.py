"""bench/quant.py --smoke: the GPU benchmark's own code path on the CPU (Triton interpreter,
tiny shapes, a tiny engine), so the script the H200 runs once does not rot."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_quant_smoke_checks_then_times_every_config(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "quant.py"), "--smoke",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=900,
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads(next(tmp_path.glob("quant-*.json")).read_text())
    assert res["copy_GBps"] > 0 and res["smoke"] is True
    for row in res["gemm"]:
        assert row["configs"] and not any("error" in c or c.get("wrong")
                                          for c in row["configs"].values()), row
        assert all(c["relerr"] < 2e-2 and c["us"] > 0 for c in row["configs"].values())
        assert row["default"] in row["configs"] and row["best"] in row["configs"]
    assert {r["bits"] for r in res["gemm"]} == {4, 8}
    assert res["tuned"] and all(v.startswith("m16") or v.startswith("m64")
                                for v in res["tuned"].values())
    bf16, int4 = res["engine"]["bf16"], res["engine"]["int4"]
    assert int4["summary"] == "gptq int4 g32 (sym), kept quantized" and bf16["summary"] is None
    assert int4["weight_bytes"] < bf16["weight_bytes"]
    for rate in bf16["rates"] + int4["rates"]:
        assert rate["tokens"] == rate["batch"] * rate["steps"] and rate["tok_s"] > 0
    assert "int4/bf16" in r.stdout and "tuned tiles" in r.stdout
