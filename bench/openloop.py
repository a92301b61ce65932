"""Open-loop service latency (docs/benchmarks.md, definition 5), run by
``bench/service.py --rate``: workload-1 jobs arrive as a Poisson process at each given rate
(jobs/s) into Redis and one worker; per rate, achieved throughput, queue wait, TTFT and ITL.

Each rate gets its own requests (seeded, definition 1's distributions), so no rate finds
another's prompts in the worker's prefix cache; the worker has drained before the next
rate starts. Submissions come from their own thread (sync Client) at their scheduled
times, so that reading hundreds of token streams in the event loop never holds one back;
its lag behind the schedule is measured and reported. TTFT runs from the submit call to
the first token event read; queue wait = the job record's started_at - created_at (both
from Redis's clock). Jobs submitted in the first --settle seconds of a rate are left out
of the latency figures, and throughput counts only tokens read between --settle and the
last arrival (the steady state, without the ramp and the drain).
"""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

from serving import MODEL, PREFIX, Served

from pagedq.producer import AsyncClient, Client, JobRequest
from pagedq.wire.settings import Settings

FRACTIONS = "0.1,0.25,0.5,0.75,0.9,1.1"  # of the saturation rate, for --rate auto
# quantiles stored for the CDF plots (the JSON holds these, not every sample)
CDF_Q = [i / 100 for i in range(99)] + [0.99 + i / 1000 for i in range(11)]


def add_args(ap) -> None:
    g = ap.add_argument_group("open-loop mode (docs/benchmarks.md, definition 5)")
    g.add_argument("--rate", nargs="+", default=None, metavar="R",
                   help="arrival rates in jobs/s, or 'auto': --fractions of the saturation "
                        "rate (closed-mode throughput / mean output length) (default: off, "
                        "closed mode)")
    g.add_argument("--fractions", default=FRACTIONS,
                   help="with --rate auto: the rates as fractions of saturation "
                        "(default: %(default)s)")
    g.add_argument("--saturation", type=float, default=None, metavar="JOBS_S",
                   help="with --rate auto: the saturation rate, instead of measuring it with "
                        "a closed run first (default: measure)")
    g.add_argument("--duration", type=float, default=None,
                   help="seconds of arrivals per rate (default: --jobs-per-rate)")
    g.add_argument("--jobs-per-rate", type=int, default=200,
                   help="jobs per rate when --duration is not given (default: %(default)s)")
    g.add_argument("--settle", type=float, default=0.0,
                   help="seconds at the start of each rate left out of the figures "
                        "(default: %(default)s)")
    g.add_argument("--seed", type=int, default=0,
                   help="seed of the arrivals and requests (default: %(default)s)")


def parse_rates(args) -> list[float] | None:
    """The explicit rates, or None for 'auto'. Raises SystemExit with one line when bad."""
    if args.rate == ["auto"]:
        return None
    try:
        rates = [float(r) for r in args.rate]
    except ValueError:
        raise SystemExit(f"--rate: give 'auto' or numbers (jobs/s), got {args.rate}") from None
    if any(r <= 0 for r in rates):
        raise SystemExit(f"--rate: rates must be > 0, got {args.rate}")
    return sorted(rates)


def check_args(args) -> None:
    """One line and exit for a bad open-loop option (before anything starts)."""
    if args.duration is not None and args.duration <= 0:
        raise SystemExit(f"--duration must be > 0, got {args.duration}")
    if args.jobs_per_rate < 1:
        raise SystemExit(f"--jobs-per-rate must be >= 1, got {args.jobs_per_rate}")
    if args.settle < 0:
        raise SystemExit(f"--settle must be >= 0, got {args.settle}")
    if args.saturation is not None and args.saturation <= 0:
        raise SystemExit(f"--saturation must be > 0, got {args.saturation}")


def fractions(args) -> list[float]:
    try:
        fs = sorted(float(x) for x in args.fractions.split(","))
    except ValueError:
        raise SystemExit(f"--fractions: comma-separated numbers, got {args.fractions!r}") from None
    if not fs or fs[0] <= 0:
        raise SystemExit(f"--fractions: fractions must be > 0, got {args.fractions!r}")
    return fs


def pct(xs: list[float], q: float) -> float:
    """xs sorted; the same rank rule as bench/service.py's closed mode."""
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def requests(n: int, seed: int, smoke: bool) -> list[JobRequest]:
    """n workload-1 jobs (docs/benchmarks.md definition 1) from random.Random(seed)."""
    rnd, out = random.Random(seed), []
    for _ in range(n):
        prompt = [rnd.randint(0, 10000) for _ in range(rnd.randint(100, 1024))]
        max_tokens = rnd.randint(100, 1024)
        if smoke:
            prompt, max_tokens = prompt[:16], 16
        out.append(JobRequest(prompt=prompt, max_tokens=max_tokens, temperature=0.6,
                              ignore_eos=True, model=MODEL))
    return out


def arrivals(rate: float, rnd: random.Random, n: int | None, duration: float | None) -> list[float]:
    """Offsets (s) of a Poisson process of ``rate``: n of them, or those before duration."""
    t, out = 0.0, []
    while True:
        t += rnd.expovariate(rate)
        if (duration is not None and t > duration) or (duration is None and len(out) >= n):
            return out
        out.append(t)


@dataclass
class Job:
    offset: float  # scheduled arrival, seconds after the rate's start
    submitted: float = 0.0  # perf_counter when submit was called
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    events: list[tuple[float, int]] = field(default_factory=list)  # (read at, tokens)
    tokens: int = 0
    end: float = 0.0
    queue_wait: float | None = None
    status: str = ""


def submit_on_schedule(url: str, reqs: list[JobRequest], jobs: list[Job], t0: float,
                       hand_over, lag: list[float]) -> None:
    """Thread body: submit reqs[i] at t0 + jobs[i].offset; hand_over(i, job_id) each."""
    with Client(settings=settings(url)) as c:
        for i, (req, job) in enumerate(zip(reqs, jobs, strict=True)):
            due = t0 + job.offset
            if (wait := due - time.perf_counter()) > 0:
                time.sleep(wait)
            job.submitted = time.perf_counter()
            lag.append(job.submitted - due)
            hand_over(i, c.submit_request(req))


def settings(url: str) -> Settings:
    # a stream reader holds a connection while it blocks: allow more than the jobs in flight
    return Settings(redis_url=url, prefix=PREFIX, model=MODEL, client_max_connections=8192)


async def follow(c: AsyncClient, job_id: str, job: Job) -> None:
    last = None
    async for ev in c.stream(job_id, timeout=600):
        now = time.perf_counter()
        if ev.type != "token":
            continue
        n = len(ev.token_ids)
        job.tokens += n
        job.events.append((now, n))
        if last is None:
            job.ttft = now - job.submitted
        else:
            job.itl.extend([(now - last) / n] * n)
        last = now
    job.end = time.perf_counter()
    rec = await c.status(job_id)
    job.status = str(rec.status)
    if rec.started_at is not None and rec.created_at is not None:
        job.queue_wait = rec.started_at - rec.created_at


async def run_rate(c: AsyncClient, url: str, rate: float, reqs: list[JobRequest],
                   offsets: list[float], settle: float) -> dict:
    jobs = [Job(o) for o in offsets]
    loop = asyncio.get_running_loop()
    followers: list[asyncio.Task] = []
    lag: list[float] = []

    def hand_over(i: int, job_id: str) -> None:  # called from the submitting thread
        loop.call_soon_threadsafe(
            lambda: followers.append(loop.create_task(follow(c, job_id, jobs[i]))))

    t0 = time.perf_counter() + 0.05  # the thread starts before the first arrival
    await asyncio.to_thread(submit_on_schedule, url, reqs, jobs, t0, hand_over, lag)
    while len(followers) < len(jobs):  # the last hand-overs may still be queued
        await asyncio.sleep(0)
    await asyncio.gather(*followers)
    return summarize(rate, jobs, reqs, lag, t0, settle)


def summarize(rate: float, jobs: list[Job], reqs: list[JobRequest], lag: list[float],
              t0: float, settle: float) -> dict:
    w0, w1 = t0 + settle, t0 + jobs[-1].offset  # steady state: settle .. last arrival
    if w1 - w0 < 1e-3:
        w0, w1 = t0, max(j.end for j in jobs)
    in_window = sum(n for j in jobs for t, n in j.events if w0 <= t <= w1)
    kept = [j for j in jobs if j.offset >= settle] or jobs
    ttft = sorted(j.ttft for j in kept if j.ttft is not None)
    itl = sorted(x for j in kept for x in j.itl)
    qw = sorted(j.queue_wait for j in kept if j.queue_wait is not None)
    lag = sorted(lag)
    mean_out = sum(r.max_tokens for r in reqs) / len(reqs)
    tokens = sum(j.tokens for j in jobs)
    r = dict(rate=rate, jobs=len(jobs), jobs_measured=len(kept),
             finished=sum(j.status == "finished" for j in jobs),
             arrival_span_s=jobs[-1].offset, achieved_arrival_rate=len(jobs) / jobs[-1].offset,
             offered_tok_s=rate * mean_out, tok_s=in_window / (w1 - w0),
             tokens=tokens, expected_tokens=sum(r.max_tokens for r in reqs),
             tok_s_incl_drain=tokens / (max(j.end for j in jobs) - t0),
             submit_lag_p50=pct(lag, .5), submit_lag_p99=pct(lag, .99), submit_lag_max=lag[-1])
    for name, xs in (("ttft", ttft), ("itl", itl), ("queue_wait", qw)):
        for q in (50, 90, 99):
            r[f"{name}_p{q}"] = pct(xs, q / 100)
    r["ttft_cdf"] = [pct(ttft, q) for q in CDF_Q]
    r["itl_cdf"] = [pct(itl, q) for q in CDF_Q]
    return r


async def warm_up(c: AsyncClient, smoke: bool) -> None:
    """32 jobs of the workload's prompt lengths, 8 tokens each, at once (as offline.py)."""
    reqs = [r.model_copy(update={"max_tokens": 8}) for r in requests(32, 10_000, smoke)]
    for j in await c.submit_many(reqs):
        await c.result(j, timeout=1200)


async def run(url: str, rates: list[float], args) -> list[dict]:
    """Each rate in turn on the served worker (warmed up first); the per-rate dicts."""
    out = []
    async with AsyncClient(settings=settings(url)) as c:
        await warm_up(c, args.smoke)
        for k, rate in enumerate(rates):
            rnd = random.Random(args.seed * 1000 + k)
            offsets = arrivals(rate, rnd, args.jobs_per_rate, args.duration)
            if not offsets:
                raise SystemExit(f"rate {rate}: no arrival within --duration {args.duration}")
            reqs = requests(len(offsets), args.seed * 1000 + 500 + k, args.smoke)
            r = await run_rate(c, url, rate, reqs, offsets, args.settle)
            print(line(r, out[0] if out else r), flush=True)
            out.append(r)
    return out


HEADER = ("  rate   arrived   tok/s  offered | queue wait p50/p90/p99 s | TTFT p50/p90/p99 s | "
          "ITL p50/p90/p99 ms | p99/low | lag p99/max ms")


def line(r: dict, low: dict) -> str:
    return (f"{r['rate']:6.2f} {r['achieved_arrival_rate']:6.2f}/s {r['tok_s']:7.0f} "
            f"{r['offered_tok_s']:8.0f} | {r['queue_wait_p50']:.3f}/{r['queue_wait_p90']:.3f}/"
            f"{r['queue_wait_p99']:.3f} | {r['ttft_p50']:.3f}/{r['ttft_p90']:.3f}/"
            f"{r['ttft_p99']:.3f} | {r['itl_p50'] * 1e3:.1f}/{r['itl_p90'] * 1e3:.1f}/"
            f"{r['itl_p99'] * 1e3:.1f} | {r['ttft_p99'] / low['ttft_p99']:6.2f}x | "
            f"{r['submit_lag_p99'] * 1e3:.1f}/{r['submit_lag_max'] * 1e3:.1f}")


def main(args, env: dict[str, str], closed_drive) -> int:
    """bench/service.py --rate. closed_drive: the closed mode's driver (service.drive), run
    first on the same worker when --rate auto must measure the saturation rate."""
    import json
    import os

    from offline import workload
    check_args(args)
    rates = parse_rates(args)
    fs = None if rates is not None else fractions(args)
    sat = None
    with Served(args.shape, env) as srv:
        if rates is None:
            if args.saturation:
                sat = dict(jobs_s=args.saturation, source="--saturation")
            else:
                prompts, params = workload(args.num_seqs)
                if args.smoke:
                    prompts = [p[:16] for p in prompts]
                    for sp in params:
                        sp.max_tokens = 16
                closed = asyncio.run(closed_drive(srv.url, prompts, params))
                mean_out = closed["service_tokens"] / args.num_seqs
                sat = dict(jobs_s=closed["service_tok_s"] / mean_out, source="closed run",
                           closed_jobs=args.num_seqs, closed_tok_s=closed["service_tok_s"],
                           closed_ttft_p99=closed["ttft_p99"], mean_output_tokens=mean_out)
                print(f"closed run: {closed['service_tok_s']:.0f} tok/s, {mean_out:.1f} "
                      f"tokens/job -> saturation {sat['jobs_s']:.2f} jobs/s", flush=True)
            rates = [f * sat["jobs_s"] for f in fs]
        print(HEADER, flush=True)
        results = asyncio.run(run(srv.url, rates, args))
    import torch
    res = dict(mode="open-loop", shape=args.shape, smoke=args.smoke, seed=args.seed,
               duration=args.duration, jobs_per_rate=None if args.duration else args.jobs_per_rate,
               settle=args.settle, saturation=sat, fractions=fs, cdf_q=CDF_Q, rates=results,
               worker=srv.stats,
               device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    if fs and 0.5 in fs:
        half, low = results[fs.index(0.5)], results[0]
        res["ttft_p99_half_over_low"] = half["ttft_p99"] / low["ttft_p99"]
        print(f"TTFT p99 at 50% of saturation / at {fs[0]:.0%}: "
              f"{half['ttft_p99']:.3f} / {low['ttft_p99']:.3f} s = "
              f"{res['ttft_p99_half_over_low']:.2f} (issue 15's bar: < 3)")
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"service-openloop-{args.shape}{'-smoke' if args.smoke else ''}.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {path}")
    try:
        import matplotlib  # noqa: F401 - absent on the GPU machine
    except ImportError:
        print(f"matplotlib absent: plot elsewhere with python bench/plot.py {path}")
    else:
        import plot
        for png in plot.make(path):
            print(f"wrote {png}")
    ok = all(r["finished"] == r["jobs"] and r["tokens"] == r["expected_tokens"] for r in results)
    if not ok:
        print("some jobs did not finish with all their tokens (see finished / tokens)")
    return 0 if ok else 1
