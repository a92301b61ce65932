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
        kernels = row["kernels"]
        assert not any("error" in e or e.get("wrong") for e in kernels.values()), row
        assert all(e["relerr"] < 2e-2 and e["us"] > 0 for e in kernels.values())
        assert {"bf16", "auto"} <= set(kernels) and row["best"] in kernels
        assert any(lab.startswith("tiles:") for lab in kernels)
        if row["M"] <= 16:  # the few-rows kernels (swept beside their default for sym int4)
            want = 2 if row["bits"] == 4 and not row["asym"] else 1
            assert sum(lab.startswith("decode:") for lab in kernels) >= want, row
        assert row["copies"] >= 2  # the weights rotate
    assert {r["bits"] for r in res["gemm"]} == {4, 8}
    assert res["tuned"] and all(v.startswith("decode:") for v in res["tuned"].values())
    bf16, int4 = res["engine"]["bf16"], res["engine"]["int4"]
    assert int4["summary"] == "gptq int4 g32 (sym), kept quantized" and bf16["summary"] is None
    assert int4["weight_bytes"] < bf16["weight_bytes"]
    for rate in bf16["rates"] + int4["rates"]:
        assert rate["tokens"] == rate["batch"] * rate["steps"] and rate["tok_s"] > 0
    assert "int4/bf16" in r.stdout and "tuned plans" in r.stdout
