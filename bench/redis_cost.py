"""Redis cost of the token path (docs/benchmarks.md #8), without a GPU.

Simulated workers run the real worker publish path: jobs submitted by real clients
(AsyncClient.submit_many: the SUBMIT script), taken with XREADGROUP and started with the
real START script, then token events written by the real ``pagedq.worker.publisher.Publisher``
(PUBLISH script: XADD to the job's out stream + PUBLISH) and ended by its FINISH script.
Each step writes one event per running job carrying ``--tokens-per-event`` tokens (what
the H200 worker's coalescing produces: 1.0 with PAGEDQ_COALESCE_MS=0, ~2.3 by default), and
waits until the publisher has written it (one round trip per step, so events are never
merged further). Readers are real clients: every job is read to its final event with
AsyncClient.stream (XREAD on its out stream), so reads are costed too.

Measured over a window after a warm-up: redis-server CPU seconds (INFO cpu, user + sys,
summed over the masters), tokens and events written by the workers, tokens the readers
saw. Reported: CPU-s per million tokens, events/s, tokens/s, each master's busy fraction
(about 1.0: that master is saturated), and, derived from the cost, how many tokens/s one
fully busy Redis core would carry and so how many GPU workers at ``--service-rate``.

  python bench/redis_cost.py [--target single|cluster|both] [--workers 2] [--readers 2]
      [--running 256] [--max-tokens 256] [--tokens-per-event 1] [--step-hz 0]
      [--masters 3] [--partitions 6] [--duration 10] [--out DIR]

``single``: one redis-server, PAGEDQ_PARTITIONS=1. ``cluster``: ``--masters`` cluster-mode
redis-servers formed without redis-cli (tests/cluster_fixture.py), PAGEDQ_REDIS_CLUSTER=1
and ``--partitions`` partitions, with ``--masters`` times the generators (unless
``--cluster-workers`` / ``--cluster-readers``). ``both``: the two, and the ratio of their
aggregate rates. Only a machine with a core for each redis-server and enough for the
generators can show the cluster's scale-out; the core count is printed with the figures.
After the window, submitting stops and every job is read to its end: the totals check
that the readers saw exactly the tokens the workers wrote.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import sys
import time
from dataclasses import asdict, dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import redis  # noqa: E402

from pagedq.wire.keys import GROUP, Keys  # noqa: E402
from pagedq.wire.settings import Settings  # noqa: E402

PREFIX, MODEL = "bench", "bench"
PROMPT_TOKENS = 16
MIN_CORES = 8  # 3 masters + generators: fewer cores cap the cluster's figure
# per-process counters (one writer each, the parent reads): shared arrays' columns
PUB_TOKENS, PUB_EVENTS, SEEN_TOKENS, JOBS_DONE, BAD_JOBS = range(5)


@dataclass
class Load:
    url: str
    cluster: bool
    partitions: int
    workers: int
    readers: int
    running: int  # jobs one worker runs at once (its batch)
    inflight: int  # jobs one reader keeps submitted and streams
    max_tokens: int
    tokens_per_event: int
    step_hz: float  # 0: steps as fast as the round trips allow
    prefix: str = PREFIX


def settings_of(load: Load) -> Settings:
    return Settings(redis_url=load.url, redis_cluster=load.cluster, partitions=load.partitions,
                    prefix=load.prefix, model=MODEL, coalesce_ms=0, client_retry_s=10)


# ---------------------------------------------------------------- simulated worker

def worker_main(load: Load, idx: int, counters, stop_work) -> None:
    """One worker process: intake (XREADGROUP + START), then per step one event per
    running job through the real Publisher, FINISH after a job's last token."""
    import structlog

    from pagedq.wire import script
    from pagedq.wire.connection import connect
    from pagedq.wire.schema import FinishReason, Status
    from pagedq.wire.worker_scripts import Move, Start, StartKind
    from pagedq.worker.publisher import Final, Publisher

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    s = settings_of(load)
    r = connect(s, decode_responses=True)
    script.prepare(r)  # FCALL (Redis >= 7) or EVALSHA, for the publisher's pipelines
    spaces = Keys(load.prefix).spaces(load.partitions)
    for k in spaces:
        with contextlib.suppress(redis.ResponseError):  # BUSYGROUP: made by MOVE already
            r.xgroup_create(k.jobs(MODEL), GROUP, id="0", mkstream=True)
    pub = Publisher(r, s).start()
    wid = f"sim-{idx}"
    running: dict[str, list] = {}  # uid -> [keys, job id, attempt, entry id, tokens left]
    turn, next_poll = 0, 0.0
    period = 1.0 / load.step_hz if load.step_hz > 0 else 0.0
    tick = time.perf_counter()
    text = " w" * load.max_tokens
    while True:
        now = time.perf_counter()
        room = load.running - len(running)
        if room > 0 and now >= next_poll:
            got = 0
            for j in range(len(spaces)):  # every partition, from a rotating first one
                k = spaces[(turn + j) % len(spaces)]
                block = 100 if not running and j == len(spaces) - 1 and not got else None
                script.run(r, Move(k, MODEL, "interactive", room))  # SUBMIT's inbox -> stream
                resp = r.xreadgroup(GROUP, wid, {k.jobs(MODEL): ">"}, count=room, block=block)
                for entry_id, fields in (resp[0][1] if resp else []):
                    job_id = fields["job"]
                    res = script.run(r, Start(k, job_id, MODEL, "interactive", wid,
                                              s.max_deliveries))
                    if res.kind is not StartKind.ok:
                        continue
                    pub.register(k, job_id, res.attempt, 0)
                    running[k.job(job_id)] = [k, job_id, res.attempt, entry_id, load.max_tokens]
                    got += 1
                room = load.running - len(running)
                if room <= 0:
                    break
            turn += 1
            if not got:
                next_poll = now + 0.01  # as the worker's PAGEDQ_INTAKE_POLL_MS
        if not running:
            if stop_work.is_set():
                break
            continue
        batch, ended, tokens = [], [], 0
        for uid, job in running.items():
            n = min(load.tokens_per_event, job[4])
            job[4] -= n
            tokens += n
            batch.append((uid, job[2], None, " w" * n, [7] * n, None,
                          "length" if job[4] == 0 else None, None))  # (no event head)
            if job[4] == 0:
                ended.append(uid)
        pub.tokens(batch)
        for uid in ended:
            k, job_id, attempt, entry_id, _ = running.pop(uid)
            pub.final(Final(k, job_id, attempt, entry_id, k.jobs(MODEL), Status.finished,
                            FinishReason.length, text, "", PROMPT_TOKENS, load.max_tokens))
        pub.flush()
        counters[PUB_TOKENS] += tokens
        counters[PUB_EVENTS] += len(batch)
        if period:
            tick += period
            time.sleep(max(0.0, tick - time.perf_counter()))
    pub.stop()


def worker_entry(load: Load, idx: int, counters, stop_work) -> None:
    worker_main(load, idx, counters, stop_work)


# ---------------------------------------------------------------- readers

def reader_entry(load: Load, counters, stop_submit) -> None:
    asyncio.run(reader_main(load, counters, stop_submit))


async def reader_main(load: Load, counters, stop_submit) -> None:
    """``load.inflight`` slots, each: submit one job, read it to its final event, again,
    until ``stop_submit``."""
    from pagedq.producer import AsyncClient, JobRequest

    req = JobRequest(prompt=[1] * PROMPT_TOKENS, max_tokens=load.max_tokens, ignore_eos=True,
                     model=MODEL)
    async with AsyncClient(settings=settings_of(load)) as c:
        async def slot() -> None:
            while not stop_submit.is_set():
                # one job per call: AsyncClient.submit_many loses its calls on an asyncio
                # cluster client (see the report of this bench's session)
                job_id = await c.submit_request(req)
                seen, final = 0, None
                async for ev in c.stream(job_id, timeout=120):
                    if ev.type == "token":
                        seen += len(ev.token_ids)
                        counters[SEEN_TOKENS] += len(ev.token_ids)
                    else:
                        final = ev
                counters[JOBS_DONE] += 1
                if final is None or final.status != "finished" or seen != load.max_tokens:
                    counters[BAD_JOBS] += 1

        # one call before the concurrent ones: an asyncio cluster client that many tasks
        # use first at once (each starting its lazy initialize) cuts connections under them
        await c.served_models()
        await asyncio.gather(*[slot() for _ in range(load.inflight)])


# ---------------------------------------------------------------- Redis targets

def balanced_prefix(masters: int, partitions: int) -> str:
    """A prefix whose partitions fall evenly on masters that split the slots by range
    (as tests/cluster_fixture.py does): ``bench``, else the first ``bench<i>`` that does.
    A deployment gets the same by moving slots (docs/deployment.md "Redis Cluster")."""
    from redis.crc import key_slot

    from tests.cluster_fixture import SLOTS

    per, best = SLOTS // masters, (None, PREFIX)
    for i in range(2000):
        prefix = PREFIX if i == 0 else f"{PREFIX}{i}"
        held = [0] * masters
        for k in Keys(prefix).spaces(partitions):
            held[min(key_slot(k.base.encode()) // per, masters - 1)] += 1
        spread = max(held) - min(held)
        if spread <= (1 if partitions % masters else 0):
            return prefix
        if best[0] is None or spread < best[0]:
            best = (spread, prefix)
    return best[1]


@contextlib.contextmanager
def single_redis(partitions: int):
    from pagedq.worker.redis_server import RedisServer

    with RedisServer() as srv:
        yield srv.url, [srv.port], [partitions]


@contextlib.contextmanager
def cluster_redis(masters: int, partitions: int, prefix: str):
    """Also yields how many of the partitions each master holds (slots are split evenly
    by range, so N partitions need not spread N/M per master)."""
    from tests.cluster_fixture import Cluster

    with Cluster(masters=masters, replicas=0, node_timeout_ms=5000) as cl:
        ports = [n.port for n in cl.nodes]
        held = [0] * len(ports)
        for k in Keys(prefix).spaces(partitions):
            held[ports.index(cl.master_of(k.base).port)] += 1
        yield cl.url, ports, held


def redis_cpu(ports: list[int]) -> list[float]:
    """CPU seconds (user + sys) each redis-server has used so far."""
    out = []
    for port in ports:
        with redis.Redis(port=port) as c:
            info = c.info("cpu")
        out.append(info["used_cpu_user"] + info["used_cpu_sys"])
    return out


def command_usec(ports: list[int]) -> dict[str, list[int]]:
    """INFO commandstats summed over the nodes: command -> [calls, usec]."""
    out: dict[str, list[int]] = {}
    for port in ports:
        with redis.Redis(port=port) as c:
            for name, st in c.info("commandstats").items():
                acc = out.setdefault(name.removeprefix("cmdstat_"), [0, 0])
                acc[0] += int(st["calls"])
                acc[1] += int(st["usec"])
    return out


def measure(load: Load, ports: list[int], warmup: float, duration: float,
            drain_timeout: float = 120.0) -> dict:
    ctx = mp.get_context("spawn")
    stop_submit, stop_work = ctx.Event(), ctx.Event()
    wc = [ctx.Array("q", 5, lock=False) for _ in range(load.workers)]
    rc = [ctx.Array("q", 5, lock=False) for _ in range(load.readers)]
    readers = [ctx.Process(target=reader_entry, args=(load, c, stop_submit), daemon=True)
               for c in rc]
    workers = [ctx.Process(target=worker_entry, args=(load, i, c, stop_work), daemon=True)
               for i, c in enumerate(wc)]
    procs = readers + workers
    for p in procs:
        p.start()

    def total(cs, col: int) -> int:
        return sum(c[col] for c in cs)

    try:
        deadline = time.monotonic() + 60
        while total(wc, PUB_TOKENS) == 0:  # every process has started and tokens flow
            if time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in procs):
                raise RuntimeError("no token was published within 60 s (a process failed?)")
            time.sleep(0.05)
        time.sleep(warmup)
        cmd0, cpu0, t0 = command_usec(ports), redis_cpu(ports), time.perf_counter()
        tok0, ev0, seen0 = total(wc, PUB_TOKENS), total(wc, PUB_EVENTS), total(rc, SEEN_TOKENS)
        time.sleep(duration)
        cpu1, t1, cmd1 = redis_cpu(ports), time.perf_counter(), command_usec(ports)
        tok1, ev1, seen1 = total(wc, PUB_TOKENS), total(wc, PUB_EVENTS), total(rc, SEEN_TOKENS)
        # drain: no new jobs; every job submitted is run and read to its end
        stop_submit.set()
        end = time.monotonic() + drain_timeout
        for p in readers:
            p.join(max(0.1, end - time.monotonic()))
        stop_work.set()
        for p in workers:
            p.join(max(0.1, end - time.monotonic()))
        failed = [p.exitcode for p in procs if p.exitcode != 0]
        if failed:
            raise RuntimeError(f"load processes ended badly (exit codes {failed})")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    wall = t1 - t0
    cpu = [b - a for a, b in zip(cpu0, cpu1, strict=True)]
    tokens, events = tok1 - tok0, ev1 - ev0
    # where the time inside commands went (scripts count their inner calls too), per event
    cmds = {n: [c - cmd0.get(n, [0, 0])[0], u - cmd0.get(n, [0, 0])[1]]
            for n, (c, u) in cmd1.items()}
    top = sorted(((n, c, u) for n, (c, u) in cmds.items() if c), key=lambda x: -x[2])[:8]
    return dict(
        commands_per_event={n: dict(calls=round(c / max(events, 1), 3),
                                    us=round(u / max(events, 1), 2)) for n, c, u in top},
        seconds=round(wall, 3), tokens=tokens, events=events,
        tokens_per_s=round(tokens / wall, 1), events_per_s=round(events / wall, 1),
        mean_tokens_per_event=round(tokens / max(events, 1), 3),
        reader_tokens_per_s=round((seen1 - seen0) / wall, 1),
        redis_cpu_s=round(sum(cpu), 3), redis_busy=[round(x / wall, 3) for x in cpu],
        cpu_s_per_million_tokens=round(sum(cpu) / max(tokens, 1) * 1e6, 3),
        cpu_us_per_event=round(sum(cpu) / max(events, 1) * 1e6, 2),
        totals=dict(tokens_written=total(wc, PUB_TOKENS), tokens_read=total(rc, SEEN_TOKENS),
                    events_written=total(wc, PUB_EVENTS), jobs_read=total(rc, JOBS_DONE),
                    jobs_bad=total(rc, BAD_JOBS)))


def run_target(target: str, a: argparse.Namespace) -> dict:
    cluster = target == "cluster"
    scale = a.masters if cluster else 1
    workers = (a.cluster_workers or a.workers * scale) if cluster else a.workers
    readers = (a.cluster_readers or a.readers * scale) if cluster else a.readers
    partitions = a.partitions if cluster else 1
    prefix = balanced_prefix(a.masters, partitions) if cluster else PREFIX
    with (cluster_redis(a.masters, partitions, prefix) if cluster
          else single_redis(partitions)) as (url, ports, held):
        load = Load(url, cluster, partitions, workers, readers, a.running,
                    a.inflight or max(1, a.running * workers // readers), a.max_tokens,
                    a.tokens_per_event, a.step_hz, prefix)
        res = measure(load, ports, a.warmup, a.duration)
    cfg = {k: v for k, v in asdict(load).items() if k != "url"}
    res = dict(target=target, masters=scale, partitions_per_master=held, **cfg, **res)
    cost = res["cpu_s_per_million_tokens"]
    res["derived_tokens_per_s_per_redis_core"] = round(1e6 / cost) if cost > 0 else None
    res["derived_workers_per_redis_core"] = (round(1e6 / cost / a.service_rate, 2)
                                             if cost > 0 else None)
    return res


def report(res: dict, service_rate: float) -> None:
    t = res["totals"]
    print(f"{res['target']:>7} ({res['masters']} master(s), {res['partitions']} partition(s), "
          f"{res['workers']} workers x {res['running']} jobs, {res['readers']} readers, "
          f"{res['tokens_per_event']} tokens/event): {res['events_per_s']:,.0f} events/s, "
          f"{res['tokens_per_s']:,.0f} tok/s; redis-server {res['redis_cpu_s']} CPU-s in "
          f"{res['seconds']} s (busy {res['redis_busy']}, partitions "
          f"{res['partitions_per_master']}) = "
          f"{res['cpu_s_per_million_tokens']} CPU-s per million tokens, "
          f"{res['cpu_us_per_event']} us/event")
    print("         per event (INFO commandstats; scripts include their inner calls): " + ", ".join(
        f"{n} {v['calls']}x {v['us']}us" for n, v in res["commands_per_event"].items()))
    print(f"         totals: {t['tokens_written']:,} tokens written, {t['tokens_read']:,} read, "
          f"{t['jobs_read']} jobs read, {t['jobs_bad']} bad")
    if res["derived_tokens_per_s_per_redis_core"]:
        print(f"         derived: one fully busy Redis core serves about "
              f"{res['derived_tokens_per_s_per_redis_core']:,} tok/s = "
              f"{res['derived_workers_per_redis_core']} workers at {service_rate:,.0f} tok/s "
              f"each (this mix; linear extrapolation of the measured cost)")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage block
        self.exit(2, f"{self.prog}: {message}\n")


def positive(kind):
    def conv(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
        return v
    return conv


def nonneg(kind):
    def conv(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if v < 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be >= 0")
        return v
    return conv


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="redis_cost.py", description=__doc__.split("\n\n")[0],
                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", choices=("single", "cluster", "both"), default="both",
                   help="one redis-server, a Redis Cluster, or both and their ratio")
    p.add_argument("--workers", type=positive(int), default=2,
                   help="simulated worker processes (single target)")
    p.add_argument("--readers", type=positive(int), default=2,
                   help="client processes submitting and streaming jobs (single target)")
    p.add_argument("--cluster-workers", type=nonneg(int), default=0,
                   help="worker processes for the cluster (0: --masters x --workers)")
    p.add_argument("--cluster-readers", type=nonneg(int), default=0,
                   help="reader processes for the cluster (0: --masters x --readers)")
    p.add_argument("--running", type=positive(int), default=256,
                   help="jobs each worker runs at once (one event each per step)")
    p.add_argument("--inflight", type=nonneg(int), default=0,
                   help="jobs each reader keeps submitted and streaming "
                        "(0: workers x running / readers, enough to fill every seat)")
    p.add_argument("--max-tokens", type=positive(int), default=256,
                   help="tokens of each job")
    p.add_argument("--tokens-per-event", type=positive(int), default=1,
                   help="tokens each event carries (H200 worker: 1 with PAGEDQ_COALESCE_MS=0, "
                        "about 2.3 with the default coalescing)")
    p.add_argument("--step-hz", type=nonneg(float), default=0.0,
                   help="steps per second of each worker (0: as fast as its round trips "
                        "allow, to saturate Redis)")
    p.add_argument("--masters", type=positive(int), default=3, help="cluster masters")
    p.add_argument("--partitions", type=positive(int), default=6,
                   help="PAGEDQ_PARTITIONS of the cluster target (the single target uses 1)")
    p.add_argument("--warmup", type=nonneg(float), default=2.0,
                   help="seconds of load before the window")
    p.add_argument("--duration", type=positive(float), default=10.0,
                   help="seconds of the measured window")
    p.add_argument("--service-rate", type=positive(float), default=21000.0,
                   help="tok/s of one GPU worker for the derived workers-per-core figure "
                        "(workload 1 on the H200 through the service: about 21k)")
    p.add_argument("--min-cores", type=nonneg(int), default=MIN_CORES,
                   help="warn when the machine has fewer cores (the cluster's scale-out "
                        "needs one per master plus the generators')")
    p.add_argument("--out", default=None,
                   help="folder for redis-cost.json (default: print only)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    if a.target != "single" and a.partitions < a.masters:
        p.error(f"--partitions {a.partitions} < --masters {a.masters}: a master would hold "
                "no partition")
    cores = os.cpu_count() or 1
    print(f"cores: {cores}")
    if cores < a.min_cores and a.target != "single":
        print(f"warning: {cores} cores < {a.min_cores}: the redis-servers and the load "
              "generators share them, so the cluster's scale-out ratio is capped by the "
              "machine, not Redis", file=sys.stderr)
    results = {}
    for target in (("single", "cluster") if a.target == "both" else (a.target,)):
        results[target] = run_target(target, a)
        report(results[target], a.service_rate)
    out = dict(cores=cores, results=results)
    if len(results) == 2:
        s, c = results["single"], results["cluster"]
        out["scaleout_events_ratio"] = round(c["events_per_s"] / s["events_per_s"], 2)
        out["scaleout_tokens_ratio"] = round(c["tokens_per_s"] / s["tokens_per_s"], 2)
        print(f"scale-out: cluster/single = {out['scaleout_events_ratio']}x events/s, "
              f"{out['scaleout_tokens_ratio']}x tok/s on {cores} cores (bar: >= 2.5x)")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        path = os.path.join(a.out, "redis-cost.json")
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
