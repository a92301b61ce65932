"""Guided decoding benchmarks (docs/benchmarks.md, "Guided decoding").

  python bench/guided.py libs [--threads N] [--repeat 3] [--json FILE]
      llguidance against xgrammar on this CPU with the bundled SmolLM2 tokenizer
      (bench/guided_libs.py says what each column is). Needs both libraries installed.

  python bench/guided.py engine [--shape smollm2|qwen3-0.6b|...] [--num-seqs N]
                                [--fractions 0,0.1,1] [--no-async] [--smoke] [--json FILE]
      tok/s of one workload with a share of its rows guided, every share in this one
      process (one warm-up first). A guided row's output is an endless JSON array of
      objects (minItems 100000: no row ends before max_tokens), so every share computes
      the same tokens. Shapes:
        smollm2     (the CPU default) the bundled model, float32; 16 chat prompts, 48 new
                    tokens each, temperature 0.6, EOS ignored
        qwen3-0.6b  (the CUDA default; any shape of bench/offline.py) random bf16 weights,
                    workload 1 (bench/offline.py: 256 sequences); guided rows need a
                    tokenizer: --tokenizer DIR (its files are copied next to the random
                    weights; default: the bundled SmolLM2's, 49,152 tokens, from
                    ~/.cache/pagedq; tokens past it are never allowed in a guided row). For
                    a machine without the bundled model, carry a copy: mkdir -p
                    .whl/smollm2-tokenizer; cp ~/.cache/pagedq/models/SmolLM2-*/
                    tokenizer* .whl/smollm2-tokenizer/ (bench/h200.sh guided reads it)
      --smoke: a quick run of the script itself on the CPU (a tiny random model with
      SmolLM2's vocabulary, 8 sequences, 16 tokens); its figures mean nothing.

Per share: output tok/s, ms per step, the host time spent advancing matchers and filling
masks (GuidedDecoding.mask_s), and the host's wait for sampled tokens.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not __package__:  # run as a script: the checkout's root leads sys.path, bench/ after it
    sys.path[0] = ROOT
    sys.path.append(os.path.join(ROOT, "bench"))

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "color"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "color": {"enum": ["red", "green", "blue"]}}}
ENDLESS = {"type": "array", "minItems": 100000, "items": PERSON}
CHAT = ["Describe a few people as a JSON list.", "Write a JSON array of customers.",
        "List some friends and their favourite colours as JSON.", "Give me people as JSON."]


def smollm2_tokenizer_dir() -> str:
    from pagedq.engine.loader import hf_folder, resolve_model
    return str(hf_folder(resolve_model("smollm2")))


def build_engine(args):
    """(engine, prompts, params, description) of the workload (module doc)."""
    from pagedq.engine import LLMEngine, SamplingParams
    if args.shape == "smollm2":
        eng = LLMEngine("smollm2", device=args.device, max_num_seqs=args.num_seqs,
                        async_scheduling=False if args.no_async else None)
        prompts = [eng.encode(messages=[{"role": "user", "content": CHAT[i % len(CHAT)]}])
                   for i in range(args.num_seqs)]
        params = [SamplingParams(max_tokens=args.max_tokens, temperature=0.6, ignore_eos=True)
                  for _ in prompts]
        return eng, prompts, params
    import offline
    shape = args.shape
    if args.smoke:  # SmolLM2's vocabulary: guided rows use its tokenizer
        offline.SHAPES["tiny-49k"] = dict(offline.SHAPES["tiny"], vocab_size=49152)
        shape = "tiny-49k"
    folder = offline.model_folder(shape)
    tokenizer = args.tokenizer or smollm2_tokenizer_dir()
    for name in os.listdir(tokenizer):
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(os.path.join(tokenizer, name), folder)
    eng = LLMEngine(folder, load_format="dummy", max_model_len=4096, device=args.device,
                    max_num_seqs=args.num_seqs, max_num_batched_tokens=16384,
                    async_scheduling=False if args.no_async else None,
                    gpu_memory_utilization=0.9)
    prompts, params = offline.workload(args.num_seqs)
    if args.smoke:
        prompts = [p[:16] for p in prompts]
        for sp in params:
            sp.max_tokens = 16
    return eng, prompts, params


def guided_rows(n: int, share: float) -> set[int]:
    """round(n * share) rows (at least one for a share > 0), spread evenly over the n."""
    count = max(1, round(n * share)) if share > 0 else 0
    return {j * n // count for j in range(count)}


def run(eng, prompts, params, share: float) -> dict:
    import dataclasses

    from pagedq.wire.guided import GuidedSpec
    spec = GuidedSpec.of("json_schema", ENDLESS)
    rows = guided_rows(len(prompts), share)
    for k, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        eng.add_request(f"s{share}-{k}", p,
                        dataclasses.replace(sp, guided=spec) if k in rows else sp)
    mask0, wait0 = eng.guided.mask_s, eng.device_wait_s
    tokens = steps = 0
    t0 = time.perf_counter()
    while eng.has_unfinished():
        tokens += len(eng.step())
        steps += 1
    dt = time.perf_counter() - t0
    return dict(guided_share=share, guided_rows=len(rows), seconds=dt, output_tokens=tokens,
                steps=steps, throughput_tok_s=tokens / dt, ms_per_step=dt / steps * 1e3,
                mask_host_ms_per_step=(eng.guided.mask_s - mask0) / steps * 1e3,
                host_wait_s=eng.device_wait_s - wait0)


def engine_main(args) -> list[dict]:
    import torch

    from pagedq.engine import SamplingParams
    from pagedq.wire.guided import GuidedSpec
    t = time.perf_counter()
    eng, prompts, params = build_engine(args)
    load_s = time.perf_counter() - t
    # warm-up: the workload's prompt lengths, guided rows included (the tokenizer's set-up,
    # the grammar's compile and first masks happen here, not in a timed run)
    warm = [[(7 * i + j) % 10000 for j in range(len(p))] for i, p in enumerate(prompts[:32])]
    spec = GuidedSpec.of("json_schema", ENDLESS)
    for i, p in enumerate(warm):
        eng.add_request(f"warm{i}", p, SamplingParams(max_tokens=8, temperature=0.6,
                                                      ignore_eos=True,
                                                      guided=spec if i % 2 else None))
    while eng.has_unfinished():
        eng.step()
    device = torch.cuda.get_device_name() if eng.runner.device.type == "cuda" else "cpu"
    results = []
    for share in args.fractions:
        res = run(eng, prompts, params, share)
        res.update(shape=args.shape, num_seqs=len(prompts), device=device, load_s=load_s,
                   async_scheduling=eng.pipeline.allow_async, smoke=args.smoke,
                   expected_output_tokens=sum(p.max_tokens for p in params))
        print(json.dumps(res), flush=True)
        assert res["output_tokens"] == res["expected_output_tokens"], "lost tokens"
        results.append(res)
    base = results[0]["throughput_tok_s"]
    print(f"{args.shape} on {device}, {len(prompts)} sequences, async "
          f"{eng.pipeline.allow_async}:")
    print("| guided rows | tok/s | vs first | ms/step | mask host ms/step | host waited s |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['guided_share']:.0%} ({r['guided_rows']}) | {r['throughput_tok_s']:.0f} | "
              f"{r['throughput_tok_s'] / base:.3f} | {r['ms_per_step']:.2f} | "
              f"{r['mask_host_ms_per_step']:.2f} | {r['host_wait_s']:.2f} |")
    return results


def libs_main(args) -> list[dict]:
    import guided_libs

    from pagedq.engine.loader import load_tokenizer
    tok = load_tokenizer(__import__("pathlib").Path(smollm2_tokenizer_dir()))
    rows = guided_libs.measure(tok, args.threads, args.repeat)
    print(f"SmolLM2 tokenizer ({len(tok)} tokens), {args.threads} threads for 32 rows:")
    print(guided_libs.table(rows))
    return rows


def fractions(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from None
    if not values or not all(0 <= v <= 1 for v in values):
        raise argparse.ArgumentTypeError("shares must be in [0, 1], e.g. 0,0.1,1")
    return values


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    lib = sub.add_parser("libs", help="llguidance against xgrammar",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    lib.add_argument("--threads", type=int, default=os.cpu_count(),
                     help="threads of each library's batch mask call")
    lib.add_argument("--repeat", type=int, default=3, help="repetitions (best is kept)")
    lib.add_argument("--json", default=None, help="write the results to this file")
    eng = sub.add_parser("engine", help="tok/s with a share of guided rows",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    eng.add_argument("--shape", default=None,
                     help="smollm2 or a bench/offline.py shape (default: qwen3-0.6b on "
                          "CUDA, smollm2 on the CPU)")
    eng.add_argument("--num-seqs", type=int, default=None,
                     help="sequences (default: 256 for a shape, 16 for smollm2, 8 smoke)")
    eng.add_argument("--max-tokens", type=int, default=48, help="smollm2: new tokens per row")
    eng.add_argument("--fractions", type=fractions, default=[0.0, 0.1, 1.0],
                     help="shares of guided rows, one run each")
    eng.add_argument("--tokenizer", default=None,
                     help="folder of tokenizer files for a random-weight shape (default: "
                          "the bundled SmolLM2's)")
    eng.add_argument("--no-async", action="store_true", help="synchronous scheduling")
    eng.add_argument("--device", default="auto")
    eng.add_argument("--smoke", action="store_true", help="a quick CPU run of the script")
    eng.add_argument("--json", default=None, help="write the results to this file")
    args = ap.parse_args()
    if args.what == "libs":
        results = libs_main(args)
    else:
        import torch
        cuda = torch.cuda.is_available() and args.device != "cpu"
        if args.smoke:
            args.shape, args.device = args.shape or "tiny", "cpu"
            args.num_seqs = args.num_seqs or 8
        args.shape = args.shape or ("qwen3-0.6b" if cuda else "smollm2")
        args.num_seqs = args.num_seqs or (16 if args.shape == "smollm2" else 256)
        results = engine_main(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
