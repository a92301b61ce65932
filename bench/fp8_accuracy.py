"""Accuracy of the fp8 KV cache (kv_cache_dtype="fp8", float8_e4m3fn, unit scale) against
a cache in the model's dtype, on a real model and real text.

Teacher forcing (engine/scoring.py): the text is prefilled in chunks of --chunk tokens, so
every chunk after the first reads its prefix back from the paged cache, as decode does.
Each configuration's next-token distributions at every position are compared with a
float32 model + float32 cache run (the ground truth): mean KL(truth || config), top-1
agreement with the truth, and the perplexity of the text. Prints a table, writes JSON.

  python bench/fp8_accuracy.py [--model smollm2] [--device cpu] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXTS = ("README.md", "docs/protocol.md")  # English prose shipped with the project


def text_ids(tokenizer, max_tokens: int) -> list[int]:
    text = "\n\n".join(open(os.path.join(ROOT, p), encoding="utf-8").read() for p in TEXTS)
    return tokenizer.encode(text)[:max_tokens]


def against(truth, lp, ids: list[int]) -> dict:
    """One configuration's next-token log-probs ``lp`` [len(ids) - 1, vocab] against the
    truth's: mean and max KL(truth || lp), top-1 agreement, perplexity of ids[1:]."""
    import torch
    kl = (truth.exp() * (truth - lp)).sum(-1)
    nll = -lp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    return dict(tokens=len(ids), mean_kl_vs_fp32=float(kl.mean()),
                max_kl_vs_fp32=float(kl.max()),
                top1_agree_vs_fp32=float((lp.argmax(-1) == truth.argmax(-1)).float().mean()),
                perplexity=math.exp(float(nll.mean())))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from pagedq.engine.config import EngineConfig
    from pagedq.engine.model_runner import ModelRunner
    from pagedq.engine.scoring import next_token_logprobs
    configs = [("float32", "auto"), ("bfloat16", "auto"), ("bfloat16", "fp8"),
               ("float32", "fp8")]
    ids = None
    runs = {}
    for dtype, kv in configs:
        cfg = EngineConfig(device=args.device, dtype=dtype, kv_cache_dtype=kv,
                           max_model_len=args.tokens, num_kv_blocks=-(-args.tokens // 16) + 1,
                           enforce_eager=True)
        t = time.perf_counter()
        runner = ModelRunner(args.model, cfg)
        if ids is None:
            ids = text_ids(runner.tokenizer, args.tokens)
        runs[(dtype, kv)] = next_token_logprobs(runner, ids, args.chunk)
        print(f"  {dtype}/{kv}: {time.perf_counter() - t:.1f} s", file=sys.stderr)
        runner.close()  # the device memory goes before the next configuration loads
    truth = runs[("float32", "auto")]
    rows = [dict(model_dtype=dtype, kv_cache=kv if kv != "auto" else dtype,
                 **against(truth, lp, ids)) for (dtype, kv), lp in runs.items()]
    print(f"{'model':9s} {'kv cache':14s} {'mean KL':>10s} {'max KL':>8s} {'top-1':>7s} "
          f"{'ppl':>7s}   ({len(ids)} tokens of {', '.join(TEXTS)}; truth = fp32/fp32)")
    for r in rows:
        print(f"{r['model_dtype']:9s} {str(r['kv_cache']):14s} {r['mean_kl_vs_fp32']:10.2e} "
              f"{r['max_kl_vs_fp32']:8.4f} {r['top1_agree_vs_fp32']:7.2%} {r['perplexity']:7.3f}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "fp8-accuracy.json"), "w") as f:
            json.dump(dict(model=args.model, device=args.device, chunk=args.chunk, rows=rows),
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
