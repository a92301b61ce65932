"""The `pagedq` console script: worker and demo here, client commands from producer.cli.
Heavy imports (torch, the engine) happen only inside the worker/demo commands."""
from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys

from producer import cli as client_cli


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedq", description="Queue-fed LLM generation over Redis.")
    p.add_argument("--redis-url", default=None, help="default: $PAGEDQ_REDIS_URL or redis://127.0.0.1:6379/0")
    p.add_argument("--prefix", default=None, help="key prefix (default: $PAGEDQ_PREFIX or pagedq)")
    sub = p.add_subparsers(dest="command", required=True)

    w = sub.add_parser("worker", help="serve generation jobs from the model's jobs stream")
    add_engine_args(w)
    w.add_argument("--worker-id", default=None,
                   help="stable consumer name; a restarted worker with the same id re-reads its own pending jobs")
    w.add_argument("--log-level", default="info")
    w.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics on this port (default: $PAGEDQ_METRICS_PORT, 0 = off)")
    w.set_defaults(func=cmd_worker)

    d = sub.add_parser("demo", help="embedded Redis + CPU worker + a few streamed jobs")
    add_engine_args(d)
    d.add_argument("--jobs", type=int, default=6)
    d.add_argument("--max-tokens", type=int, default=48)
    d.set_defaults(func=cmd_demo)

    client_cli.register(sub)
    return p


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="'smollm2' (bundled), a local HF folder, or a .gguf file (default: $PAGEDQ_MODEL or smollm2)")
    p.add_argument("--served-name", default=None,
                   help="jobs stream name for this model (default: the --model value if it is a name, else the folder/file stem)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights from config.json alone (benchmarks)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="fp8: float8_e4m3 KV cache, twice the tokens per GiB (accuracy: "
                        "docs/benchmarks.md)")
    p.add_argument("--seed", type=int, default=None,
                   help="noise seed of jobs without their own seed (default: random per process, "
                        "so workers never share a noise stream)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    kw = {"device": args.device, "dtype": args.dtype, "load_format": args.load_format,
          "kv_cache_dtype": args.kv_cache_dtype,
          "seed": args.seed if args.seed is not None else secrets.randbits(63)}
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_kv_blocks",
                 "block_size"):
        v = getattr(args, name)
        if v is not None:
            kw[name] = v
    return kw


def served_name(model: str, explicit: str | None) -> str:
    if explicit:
        return explicit
    base = os.path.basename(os.path.normpath(model))
    return base[:-5] if base.endswith(".gguf") else base


def settings_from(args: argparse.Namespace):
    from producer.settings import Settings

    over = {}
    if args.redis_url:
        over["redis_url"] = args.redis_url
    if args.prefix:
        over["prefix"] = args.prefix
    if getattr(args, "metrics_port", None) is not None:
        over["metrics_port"] = args.metrics_port
    if getattr(args, "model", None):
        over["model"] = served_name(args.model, getattr(args, "served_name", None))
    elif getattr(args, "served_name", None):
        over["model"] = args.served_name
    return Settings(**over)


def cmd_worker(args: argparse.Namespace) -> int:
    from worker import logs

    logs.configure(args.log_level)
    settings = settings_from(args)
    from engine.llm_engine import LLMEngine
    from worker.service import Worker

    engine = LLMEngine(args.model or "smollm2", **engine_kwargs(args))
    w = Worker(engine, settings, worker_id=args.worker_id)
    install_signal_handlers(w)
    w.run()
    return 0


def install_signal_handlers(w) -> None:
    """First SIGTERM/SIGINT: stop intake and drain; a second one exits at once."""

    def handler(signum, _frame):
        if getattr(w, "_stopping", False):
            os._exit(128 + signum)
        w.request_stop()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def cmd_demo(args: argparse.Namespace) -> int:
    from worker.demo import run_demo

    return run_demo(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
