"""Where the time of one engine step goes: torch.profiler over a window of steps of
workload 1 (bench/offline.py), after --skip steps (prefill mostly done, the batch full).

Prints the kernels by device time, device time per step against wall time per step (the
gap is host work the device waits for), and writes the table as JSON.

  python bench/profile_steps.py [--shape qwen3-0.6b] [--skip 300] [--steps 30] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from offline import SHAPES, model_folder, workload  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-0.6b", choices=list(SHAPES))
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--skip", type=int, default=300)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    from pagedq.engine import LLMEngine
    with LLMEngine(model_folder(args.shape), load_format="dummy", max_model_len=4096,
                   max_num_seqs=256, max_num_batched_tokens=16384,
                   enforce_eager=args.enforce_eager) as engine:
        prompts, params = workload(args.num_seqs)
        for k, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(f"p{k}", p, sp)
        cuda = torch.cuda.is_available()  # on the CPU (a smoke run) the table is of CPU time
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        for _ in range(args.skip):
            engine.step()
        sync()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        per_token = engine.runner.block_bytes() / engine.runner.block_size  # K+V, all layers
        kv_read = 0.0  # bytes of KV the attention of these steps reads (each context once)
        with profile(activities=acts) as prof:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                kv_read += per_token * sum(s.num_computed_tokens + 1 for s in engine.scheduler.running)
                engine.step()
            sync()
            wall = time.perf_counter() - t0
        batch = len(engine.scheduler.running)
    rows = []
    for e in prof.key_averages():
        dev_us = e.self_device_time_total if cuda else e.self_cpu_time_total
        if dev_us > 0:
            rows.append(dict(name=e.key, device_us_per_step=dev_us / args.steps,
                             calls_per_step=e.count / args.steps))
    rows.sort(key=lambda r: -r["device_us_per_step"])
    dev_total = sum(r["device_us_per_step"] for r in rows)
    print(f"{args.shape}: {args.steps} steps after {args.skip}, {batch} running seqs: wall "
          f"{wall / args.steps * 1e3:.2f} ms/step, device busy {dev_total / 1e3:.2f} ms/step")
    print(f"{'device us/step':>14s} {'share':>6s} {'calls':>6s}  kernel")
    dec = sum(r["device_us_per_step"] for r in rows if "decode_kernel" in r["name"])
    if dec:
        gb = kv_read / args.steps / 1e9
        print(f"decode attention: {gb:.2f} GB of KV per step in {dec / 1e3:.2f} ms = "
              f"{gb / dec * 1e3:.2f} TB/s")
    for r in rows[:args.top]:
        print(f"{r['device_us_per_step']:14.1f} {r['device_us_per_step'] / dev_total:6.1%} "
              f"{r['calls_per_step']:6.1f}  {r['name'][:110]}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"profile-{args.shape}.json"), "w") as f:
            json.dump(dict(wall_ms_per_step=wall / args.steps * 1e3,
                           device_ms_per_step=dev_total / 1e3, running=batch,
                           kv_bytes_per_step=kv_read / args.steps, rows=rows),
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
