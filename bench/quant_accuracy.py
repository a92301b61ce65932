"""Accuracy of quantized weights on a real model and real text, on the CPU: the bundled
SmolLM2-135M against its float32 weights (bench/fp8_accuracy.py's method: the project's
prose, teacher-forced through the paged cache in chunks; mean KL to the truth, top-1
agreement, perplexity).

The bundled file is GGUF Q4_1, so its float32 weights ARE its Q4_1 weights dequantized:
that model is the truth. Rows:
  gguf Q4_1 as served: float32 (dequantized at load) and bfloat16 (kept quantized,
    dequantized per GEMM), beside bfloat16 on the float weights (quantization none)
  the float32 weights quantized again by round to nearest (tests/quant_writers.py) into
    GPTQ int4 g128 sym, AWQ int4 g64 (K = 576 takes no group of 128), GPTQ int8 g32 sym
    (Q8_0's grouping), each served by pagedq in float32 (weight error alone) and bfloat16
A second rounding of weights already on a 4-bit grid: these bound what such a
checkpoint costs here, not what AWQ/GPTQ calibration achieves from 16-bit weights.

  python bench/quant_accuracy.py [--tokens 2048] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from bench.fp8_accuracy import TEXTS, against, text_ids
    from pagedq.engine.config import EngineConfig
    from pagedq.engine.loader import hf_folder, resolve_model
    from pagedq.engine.model_runner import ModelRunner
    from pagedq.engine.scoring import next_token_logprobs
    from tests import quant_writers as qw

    src = hf_folder(resolve_model("smollm2"))  # the float32 weights (transformers' dequant)
    tmp = Path(tempfile.mkdtemp(prefix="pagedq-quant-acc-"))
    t = time.perf_counter()
    made = {"gptq int4 g128 sym": tmp / "gptq4", "awq int4 g64": tmp / "awq4",
            "gptq int8 g32 sym": tmp / "gptq8"}
    qw.write_gptq(src, made["gptq int4 g128 sym"], tmp / "d1", bits=4, group=128, sym=True)
    qw.write_awq(src, made["awq int4 g64"], tmp / "d2", group=64)
    qw.write_gptq(src, made["gptq int8 g32 sym"], tmp / "d3", bits=8, group=32, sym=True)
    print(f"  quantized checkpoints written in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    configs = [("fp32 weights (truth)", str(src), "float32", "none"),
               ("gguf Q4_1 (bundled)", "smollm2", "float32", "auto"),
               ("gguf Q4_1 (bundled)", "smollm2", "bfloat16", "auto"),
               ("fp32 weights", str(src), "bfloat16", "none")]
    for label, folder in made.items():
        configs += [(label, str(folder), "float32", "auto"), (label, str(folder), "bfloat16",
                                                                "auto")]
    ids, runs, held = None, {}, {}
    for label, model, dtype, quant in configs:
        cfg = EngineConfig(device="cpu", dtype=dtype, quantization=quant, enforce_eager=True,
                           max_model_len=args.tokens, num_kv_blocks=-(-args.tokens // 16) + 1)
        t = time.perf_counter()
        runner = ModelRunner(model, cfg)
        if ids is None:
            ids = text_ids(runner.tokenizer, args.tokens)
        runs[(label, dtype)] = next_token_logprobs(runner, ids, args.chunk)
        held[(label, dtype)] = runner.quant_summary or "plain weights"
        print(f"  {label} {dtype}: {time.perf_counter() - t:.1f} s", file=sys.stderr)
        del runner
    truth = runs[("fp32 weights (truth)", "float32")]
    rows = [dict(weights=label, dtype=dtype, held=held[(label, dtype)],
                 **against(truth, lp, ids)) for (label, dtype), lp in runs.items()]
    print(f"{'weights':22s} {'dtype':9s} {'mean KL':>10s} {'max KL':>8s} {'top-1':>7s} "
          f"{'ppl':>7s}   ({len(ids)} tokens of {', '.join(TEXTS)}; truth = fp32 weights)")
    for r in rows:
        print(f"{r['weights']:22s} {r['dtype']:9s} {r['mean_kl_vs_fp32']:10.2e} "
              f"{r['max_kl_vs_fp32']:8.4f} {r['top1_agree_vs_fp32']:7.2%} {r['perplexity']:7.3f}"
              f"   {r['held']}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "quant-accuracy.json"), "w") as f:
            json.dump(dict(model="smollm2", device="cpu", chunk=args.chunk, rows=rows), f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
