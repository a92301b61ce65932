"""`pagedq demo`: Redis (embedded if none answers) + a CPU worker process with the
bundled SmolLM2 + a handful of chat jobs submitted at once and streamed back."""
from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give three tips for learning Python.",
    "Explain what a hash table is in two sentences.",
    "Name the planets of the solar system.",
    "What is 17 times 3? Answer briefly.",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue? One sentence.",
]
COLORS = ["31", "32", "33", "34", "35", "36", "91", "92", "93", "94"]


def run_demo(args: argparse.Namespace) -> int:
    from producer.settings import Settings
    from worker.embedded import ensure_redis
    from worker.names import served_name

    settings = Settings()
    url, server = ensure_redis(args.redis_url or settings.redis_url)
    print(f"redis: {url}" + (" (embedded redis-server started)" if server else ""), flush=True)
    log_path = os.path.join(tempfile.gettempdir(), f"pagedq-demo-worker-{os.getpid()}.log")
    prefix = args.prefix or f"pagedq-demo-{os.getpid()}"
    model = args.model or "smollm2"
    cmd = [sys.executable, "-m", "worker.cli", "--redis-url", url, "--prefix", prefix,
           "worker", "--model", model, "--device", args.device, "--worker-id", "demo-worker"]
    for flag in ("max_num_seqs", "num_kv_blocks", "max_model_len", "block_size"):
        if getattr(args, flag, None) is not None:
            cmd += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    print(f"worker: starting on the CPU with {model} (log: {log_path})", flush=True)
    with open(log_path, "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT)
    try:
        asyncio.run(_submit_and_stream(url, prefix, served_name(model, args.served_name),
                                       args.jobs, args.max_tokens, proc))
        return 0
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        if server is not None:
            server.cleanup()


async def _submit_and_stream(url: str, prefix: str, model: str, n: int, max_tokens: int,
                             proc: subprocess.Popen) -> None:
    from producer import AsyncClient

    tty = sys.stdout.isatty()
    async with AsyncClient(url, prefix=prefix, model=model) as client:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
        ids = await asyncio.gather(*[
            client.submit(messages=[{"role": "user", "content": p}], max_tokens=max_tokens,
                          temperature=0.0) for p in prompts])
        print(f"submitted {n} jobs; waiting for the worker to load the model...", flush=True)
        t0 = time.monotonic()
        first: dict[int, float] = {}

        async def follow(k: int, job_id: str) -> None:
            label = f"[job {k}]"
            if tty:
                label = f"\033[{COLORS[k % len(COLORS)]}m{label}\033[0m"
            async for ev in client.stream(job_id, timeout=600):
                if proc.poll() is not None:
                    raise RuntimeError(f"worker exited with code {proc.returncode}")
                if ev.type == "token" and ev.delta:
                    first.setdefault(k, time.monotonic() - t0)
                    print(f"{label} {ev.delta!r}", flush=True)

        await asyncio.gather(*[follow(k, j) for k, j in enumerate(ids)])
        print("\nsummary:")
        for k, (job_id, prompt) in enumerate(zip(ids, prompts, strict=True)):
            rec = await client.result(job_id, timeout=60)
            print(f"  job {k} {rec.status.value:9s} {rec.finish_reason:7s} "
                  f"prompt={rec.usage.prompt_tokens:3d} completion={rec.usage.completion_tokens:3d} "
                  f"first_token_at={first.get(k, float('nan')):6.2f}s  {prompt!r} -> {rec.text!r}")
