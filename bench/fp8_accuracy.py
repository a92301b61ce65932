"""Accuracy of the 8-bit KV caches (kv_cache_dtype fp8 = fp8_e4m3, fp8_e5m2, int8) against a
cache in the model's dtype, on a real model and real text, on the CPU
(docs/benchmarks.md "KV cache accuracy").

1. Teacher forcing (engine/scoring.py): the text is prefilled in chunks of --chunk tokens,
   so every chunk after the first reads its prefix back from the paged cache, as decode
   does. Each configuration's next-token distributions at every position are compared with
   a float32 model + float32 cache run (the truth): mean and max KL(truth || config), top-1
   agreement with the truth, the perplexity of the text, and its change against the same
   model with its own dtype's cache.
2. Greedy generation through the engine (LLMEngine, bf16 model): --prompts prompts cut from
   the text, --max-tokens tokens each, with each 8-bit cache against the bf16 cache: the
   share of output tokens equal at the same position, the outputs identical throughout, and
   the mean number of tokens before the first difference.
3. K and V out of e4m3's range: the same model with K and V --big times larger (k_proj and
   v_proj times it, q_proj and o_proj divided by it: the same function), float32: its own
   cache, fp8 with scales fitted to the first prefill (engine/kv_scales.py), and fp8 with
   unit scales (the fit switched off), which saturate at 448.

Prints the tables, writes JSON (--out DIR: DIR/fp8-accuracy.json).

  python bench/fp8_accuracy.py [--model smollm2] [--tokens 2048] [--chunk 256]
                               [--prompts 16] [--max-tokens 64] [--big 64] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXTS = ("README.md", "docs/protocol.md")  # English prose shipped with the project
CACHES = ("fp8", "fp8_e5m2", "int8")


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


def score(model: str, dtype: str, kv: str, ids: list[int], args, fit: bool = True):
    """Teacher-forced log-probs of ids under (model dtype, KV cache); ``fit``: False
    switches fp8 e4m3's fitting off (unit scales)."""
    from pagedq.engine.config import EngineConfig
    from pagedq.engine.model_runner import ModelRunner
    from pagedq.engine.scoring import next_token_logprobs
    cfg = EngineConfig(device=args.device, dtype=dtype, kv_cache_dtype=kv,
                       max_model_len=len(ids), num_kv_blocks=-(-len(ids) // 16) + 1,
                       enforce_eager=True)
    t = time.perf_counter()
    runner = ModelRunner(model, cfg)
    if not fit:
        for attn in runner.model.attention_layers():
            attn.fit_scales = False
    lp = next_token_logprobs(runner, ids, args.chunk)
    scales = None
    if cfg.kv_cache_dtype in ("fp8", "fp8_e4m3"):
        ks = [float(a.kv_quant["k_scale"].max()) for a in runner.model.attention_layers()]
        vs = [float(a.kv_quant["v_scale"].max()) for a in runner.model.attention_layers()]
        scales = dict(k_max=max(ks), v_max=max(vs), layers_scaled=sum(
            k > 1 or v > 1 for k, v in zip(ks, vs, strict=True)))
    runner.close()  # the device memory goes before the next configuration loads
    print(f"  {dtype}/{kv}{'' if fit else ' (unit scales)'}: "
          f"{time.perf_counter() - t:.1f} s", file=sys.stderr)
    return lp, scales


def teacher_forced(args, ids) -> list[dict]:
    runs = {}
    for dtype in ("float32", "bfloat16"):
        for kv in ("auto", *CACHES):
            runs[(dtype, kv)] = score(args.model, dtype, kv, ids, args)[0]
    truth = runs[("float32", "auto")]
    rows = []
    for (dtype, kv), lp in runs.items():
        r = dict(model_dtype=dtype, kv_cache=kv if kv != "auto" else dtype,
                 **against(truth, lp, ids))
        base = against(truth, runs[(dtype, "auto")], ids)["perplexity"]
        r["ppl_delta_vs_own_dtype_cache"] = r["perplexity"] / base - 1
        rows.append(r)
    return rows


def greedy(args, ids) -> list[dict]:
    """The engine's greedy outputs with each cache against the bf16 cache's."""
    from pagedq.engine import LLMEngine, SamplingParams
    n = args.prompts
    step = max(1, (len(ids) - 64) // n)
    prompts = [ids[i * step:i * step + 32 + (i * 7) % 32] for i in range(n)]
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    outs = {}
    for kv in ("auto", *CACHES):
        t = time.perf_counter()
        with LLMEngine(args.model, device=args.device, dtype="bfloat16", kv_cache_dtype=kv,
                       max_model_len=256, num_kv_blocks=n * 16 + 16) as llm:
            outs[kv] = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        print(f"  greedy bfloat16/{kv}: {time.perf_counter() - t:.1f} s", file=sys.stderr)
    rows = []
    for kv in CACHES:
        same = sum(a == b for x, y in zip(outs["auto"], outs[kv], strict=True)
                   for a, b in zip(x, y, strict=True))
        prefix = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b),
                       len(x)) for x, y in zip(outs["auto"], outs[kv], strict=True)]
        rows.append(dict(kv_cache=kv, prompts=n, tokens=n * args.max_tokens,
                         same_tokens=same / (n * args.max_tokens),
                         identical_outputs=sum(p == args.max_tokens for p in prefix),
                         mean_tokens_before_first_difference=sum(prefix) / n))
    return rows


def scaled_copy(model: str, factor: float) -> str:
    """A folder with ``model``'s float weights, K and V ``factor`` times larger (same
    function: k_proj, v_proj times it; q_proj, o_proj divided by it)."""
    from safetensors.torch import load_file, save_file

    from pagedq.engine.loader import hf_folder, resolve_model
    src = hf_folder(resolve_model(model))
    dst = os.path.join(tempfile.mkdtemp(prefix="pagedq-bigkv-"), "m")
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    w = load_file(path)
    for name in w:
        for proj, mul in (("k_proj", factor), ("v_proj", factor), ("q_proj", 1 / factor),
                          ("o_proj", 1 / factor)):
            if f".self_attn.{proj}.weight" in name:
                w[name] = (w[name].float() * mul).to(w[name].dtype)
    save_file(w, path, metadata={"format": "pt"})
    return dst


def out_of_range(args, ids) -> list[dict]:
    folder = scaled_copy(args.model, args.big)
    try:
        truth = score(args.model, "float32", "auto", ids, args)[0]
        rows = []
        for name, kv, fit in (("float32 cache", "auto", True),
                              ("fp8 e4m3, fitted scales", "fp8", True),
                              ("fp8 e4m3, unit scales", "fp8", False),
                              ("int8", "int8", True)):
            lp, scales = score(folder, "float32", kv, ids, args, fit)
            rows.append(dict(cache=name, **against(truth, lp, ids), scales=scales))
        return rows
    finally:
        shutil.rmtree(os.path.dirname(folder), ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="model (default: smollm2)")
    ap.add_argument("--device", default="cpu", help="device (default: cpu)")
    ap.add_argument("--tokens", type=int, default=2048, help="text tokens scored (default: 2048)")
    ap.add_argument("--chunk", type=int, default=256, help="prefill chunk (default: 256)")
    ap.add_argument("--prompts", type=int, default=16, help="greedy prompts (default: 16)")
    ap.add_argument("--max-tokens", type=int, default=64,
                    help="greedy tokens per prompt (default: 64)")
    ap.add_argument("--big", type=float, default=64.0,
                    help="K and V factor of the out-of-range model (default: 64)")
    ap.add_argument("--out", default=None, help="folder for the JSON (default: none)")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from pagedq.engine.loader import hf_folder, resolve_model
    ids = text_ids(AutoTokenizer.from_pretrained(hf_folder(resolve_model(args.model))),
                   args.tokens)
    tf, gr, big = teacher_forced(args, ids), greedy(args, ids), out_of_range(args, ids)
    print(f"\nteacher forcing: {len(ids)} tokens of {', '.join(TEXTS)}, chunks of "
          f"{args.chunk}; truth = float32 model, float32 cache")
    print(f"{'model':9s} {'kv cache':10s} {'mean KL':>9s} {'max KL':>8s} {'top-1':>7s} "
          f"{'ppl':>7s} {'ppl vs own cache':>16s}")
    for r in tf:
        print(f"{r['model_dtype']:9s} {r['kv_cache']:10s} {r['mean_kl_vs_fp32']:9.2e} "
              f"{r['max_kl_vs_fp32']:8.4f} {r['top1_agree_vs_fp32']:7.2%} "
              f"{r['perplexity']:7.3f} {r['ppl_delta_vs_own_dtype_cache']:+16.2%}")
    print(f"\ngreedy, bfloat16 model, {args.prompts} prompts x {args.max_tokens} tokens, "
          f"against the bfloat16 cache")
    print(f"{'kv cache':10s} {'same tokens':>12s} {'identical outputs':>18s} "
          f"{'tokens before 1st difference':>29s}")
    for r in gr:
        print(f"{r['kv_cache']:10s} {r['same_tokens']:12.1%} "
              f"{r['identical_outputs']:>11d} of {r['prompts']:<4d} "
              f"{r['mean_tokens_before_first_difference']:29.1f}")
    print(f"\nK and V x{args.big:g} (same function), float32 model; truth = the original model")
    print(f"{'cache':26s} {'mean KL':>9s} {'top-1':>7s} {'ppl':>8s}  scales (max K, max V)")
    for r in big:
        s = r["scales"]
        print(f"{r['cache']:26s} {r['mean_kl_vs_fp32']:9.2e} {r['top1_agree_vs_fp32']:7.2%} "
              f"{r['perplexity']:8.3f}  " + (f"{s['k_max']:.2f}, {s['v_max']:.2f} "
                                             f"({s['layers_scaled']} layers > 1)" if s else ""))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "fp8-accuracy.json"), "w") as f:
            json.dump(dict(model=args.model, device=args.device, chunk=args.chunk,
                           teacher_forced=tf, greedy=gr, big_kv=dict(factor=args.big,
                                                                     rows=big)), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
