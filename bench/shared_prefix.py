"""Shared-prefix workload: N requests (256) sharing a P-token prefix (2,048 random ids), each
with its own S-token suffix (32 random ids), M output tokens each (128), temperature 0.6,
ignore_eos; LLMEngine offline, Qwen3-0.6B shape, random weights (bench/offline.py's shapes).

  python bench/shared_prefix.py [--tree DIR] [--ab] [--num-seqs 256] [--prefix-len 2048]
                                [--suffix-len 32] [--max-tokens 128] [--smoke]

Runs: prefix caching on, then off (--on-only: on; --ab: the runtime switches below), each on a prefix
of its own (no hit across runs), after one warm-up run (8 output tokens, its own prefix).
Per run: one JSON line, then a summary: tok/s (output tokens / wall), steps, steps that
computed more tokens than there are requests (prefill steps), tokens computed in the first
steps, prefix-hit tokens, the first step() call's time (schedule of every
admission + launch: host work the device waits for) and the mean step after the prefill.

--tree DIR: import the engine from DIR: a checkout (pagedq.engine) or an old tree that
bench/old_trees.sh extracted (engine/ and kernels/ of a past commit, imported as `engine`):
the same script on the code of an earlier measurement.
--ab (this tree only): one engine, several runs, each with one thing switched off at run
time: caching on (the default), piecewise graphs off (steps that prefill run eagerly), the
arrivals' wait off (prefill_wait_steps 0), chunked prefill off, caching off; then caching on
and piecewise off with 16-token suffixes (a prefill step small enough for the piecewise
graphs: with 32, the first step's 10,240 tokens run eagerly anyway).
--smoke: the tiny model on the CPU, a few requests (a check of the script).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def import_engine(tree: str):
    """(LLMEngine, SamplingParams) of the tree at DIR."""
    sys.path.insert(0, tree)
    # an old tree has engine/ and kernels/ as top-level packages (before they were
    # pagedq.engine and pagedq.kernels): imported by that name, from that tree only
    engine = importlib.import_module(
        "pagedq.engine" if os.path.isdir(os.path.join(tree, "pagedq")) else "engine")
    return engine.LLMEngine, engine.SamplingParams


def prompts(seed: int, n: int, prefix_len: int, suffix_len: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randint(0, 10000) for _ in range(prefix_len)]
    return [prefix + [rng.randint(0, 10000) for _ in range(suffix_len)] for _ in range(n)]


def run(engine, params_cls, ids: list[list[int]], max_tokens: int, label: str) -> dict:
    params = params_cls(temperature=0.6, ignore_eos=True, max_tokens=max_tokens)
    seqs = []
    for k, p in enumerate(ids):
        rid = f"{label}-{k}"
        engine.add_request(rid, p, params)
        seqs.append(engine._live[rid].seq)  # (every tree has it) for the prefix-hit count
    steps, out_tokens, step_s, step_tokens = 0, 0, [], []
    t0 = time.perf_counter()
    while engine.has_unfinished():
        t = time.perf_counter()
        out_tokens += len(engine.step())
        step_s.append(time.perf_counter() - t)
        step_tokens.append(engine.last_step_tokens)
        steps += 1
    wall = time.perf_counter() - t0
    n = len(ids)
    prefill = [i for i, x in enumerate(step_tokens) if x > n]
    after = step_s[prefill[-1] + 2:] if prefill else step_s[1:]  # async: one step late
    return dict(label=label, output_tokens=out_tokens, seconds=wall,
                throughput_tok_s=out_tokens / wall, steps=steps, prefill_steps=len(prefill),
                first_step_tokens=step_tokens[:4], first_step_s=step_s[0],
                prefix_hit_tokens=sum(s.num_cached_tokens for s in seqs),
                mean_step_ms_after_prefill=1e3 * sum(after) / max(1, len(after)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", default=os.path.dirname(HERE),
                    help="the engine's source tree (default: this checkout)")
    ap.add_argument("--ab", action="store_true", help="the runtime switches too (see doc)")
    ap.add_argument("--on-only", action="store_true", help="only the run with caching on")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--prefix-len", type=int, default=2048)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--shape", default="qwen3-0.6b", help="bench/offline.py's shapes")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--gpu-like", action="store_true",
                    help="on the CPU: async scheduling and prefill_wait_steps 4, as with "
                         "piecewise graphs on the GPU (for step counts, not speed)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny model on the CPU, 8 short requests (a check of the script)")
    args = ap.parse_args()
    tree = os.path.abspath(args.tree)
    if not os.path.isdir(tree):
        ap.error(f"--tree: {tree} is not a folder")
    LLMEngine, SamplingParams = import_engine(tree)
    saved = list(sys.path)
    sys.path.insert(0, HERE)
    from offline import model_folder  # (it puts this checkout first on sys.path: undone, so
    sys.path[:] = saved  # an old tree's lazy imports still find its own engine and kernels)
    n = 8 if args.smoke else args.num_seqs
    kw = dict(shape="tiny", device="cpu", prefix=64, suffix=8, tokens=8) if args.smoke else dict(
        shape=args.shape, device=args.device, prefix=args.prefix_len, suffix=args.suffix_len,
        tokens=args.max_tokens)
    extra = dict(async_scheduling=True, prefill_wait_steps=4) if args.gpu_like else {}
    t = time.perf_counter()
    engine = LLMEngine(model_folder(kw["shape"]), load_format="dummy", max_model_len=4096,
                       max_num_seqs=256, max_num_batched_tokens=16384, device=kw["device"],
                       enable_prefix_caching=True, **extra)
    name = os.path.basename(tree.rstrip("/"))
    print(f"{name}: engine ready in {time.perf_counter() - t:.1f} s", flush=True)
    seed = iter(range(1, 100))
    run(engine, SamplingParams, prompts(next(seed), n, kw["prefix"], kw["suffix"]), 8, "warm")
    cfg, bm = engine.scheduler.config, engine.scheduler.bm
    runner = engine.runner
    piecewise = getattr(runner, "piecewise", None)

    def switch(label):  # -> undo
        if label == "piecewise off":
            runner.piecewise = None
            return lambda: setattr(runner, "piecewise", piecewise)
        if label == "prefill_wait_steps 0":
            old = cfg.prefill_wait_steps
            cfg.prefill_wait_steps = 0
            return lambda: setattr(cfg, "prefill_wait_steps", old)
        if label == "chunked prefill off":
            cfg.enable_chunked_prefill = False
            return lambda: setattr(cfg, "enable_chunked_prefill", True)
        if label == "caching off":
            bm.enable_prefix_caching = False
            return lambda: setattr(bm, "enable_prefix_caching", True)
        return lambda: None

    labels = ["caching on"] if args.on_only else ["caching on", "caching off"]
    if args.ab:  # the default again last: the spread. A short suffix makes the prefill
        # step fit the piecewise graphs (<= 8,192 tokens: 2,048 + 256 x 16 - 16 hit)
        labels = ["caching on", "piecewise off", "prefill_wait_steps 0", "chunked prefill off",
                  "caching off", "caching on", "caching on/suffix 16", "piecewise off/suffix 16"]
    for label in labels:
        switch_name, _, other = label.partition("/suffix ")
        suffix = int(other) if other else kw["suffix"]
        undo = switch(switch_name)
        try:
            r = run(engine, SamplingParams, prompts(next(seed), n, kw["prefix"], suffix),
                    kw["tokens"], label.replace(" ", "_").replace("/", "_"))
        finally:
            undo()
        r.update(tree=name, switch=label, piecewise_captured=piecewise is not None,
                 prefill_wait_steps=cfg.prefill_wait_steps, num_seqs=n, prefix_len=kw["prefix"],
                 suffix_len=suffix, max_tokens=kw["tokens"])
        print(json.dumps(r), flush=True)
        print(f"{name:10s} {label:22s} {r['throughput_tok_s']:8.0f} tok/s  {r['seconds']:.3f} s  "
              f"{r['steps']} steps ({r['prefill_steps']} prefill; first {r['first_step_tokens']} "
              f"tokens)  hits {r['prefix_hit_tokens']}  first step() {r['first_step_s'] * 1e3:.0f}"
              f" ms  then {r['mean_step_ms_after_prefill']:.2f} ms/step", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
