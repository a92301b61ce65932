"""Tensor parallelism: workload 1 (bench/offline.py, docs/benchmarks.md) of one model shape
at several tensor_parallel_size values, each in its own process (random bf16 weights, no
checkpoint), and the throughput ratio to the first. One JSON object on stdout.

  python3 bench/tp.py --shape llama-3.1-8b --tp 1 2        # TP=2 vs TP=1 on two H200s
  python3 bench/tp.py --shape llama-3.1-70b --tp 2         # does not fit one H200
  python3 bench/tp.py --shape qwen3-0.6b --tp 1 2 --device cpu --num-seqs 2 --smoke  # CPU check

Runs that fail or time out are reported with their last output lines and make the exit
code 1. NVLink multicast stays off in every process (engine/distributed.py sets the
variables when unset; they are set here too, for the bench processes themselves).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}


def run_one(args: argparse.Namespace, tp: int, extra: list[str]) -> dict:
    cmd = [sys.executable, os.path.join(ROOT, "bench", "offline.py"), "--shape", args.shape,
           "--num-seqs", str(args.num_seqs), "--tensor-parallel-size", str(tp), *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for k, v in NVLS_OFF.items():
        env.setdefault(k, v)
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env,
                           cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return {"tensor_parallel_size": tp, "error": f"timed out after {args.timeout}s",
                "tail": out.splitlines()[-5:]}
    for line in p.stdout.splitlines():
        if line.startswith("{"):
            res = json.loads(line)
            res["returncode"] = p.returncode
            return res
    return {"tensor_parallel_size": tp, "error": f"exit {p.returncode}",
            "tail": (p.stdout + p.stderr).splitlines()[-12:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-3.1-8b",
                    help="a shape of bench/offline.py (default: %(default)s)")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2],
                    help="tensor_parallel_size values, the first is the baseline "
                         "(default: %(default)s)")
    ap.add_argument("--num-seqs", type=int, default=256, help="(default: %(default)s)")
    ap.add_argument("--timeout", type=float, default=290.0,
                    help="seconds per run (default: %(default)s)")
    ap.add_argument("--out", default=None, help="folder for the JSON result (default: none)")
    args, extra = ap.parse_known_args()  # the rest goes to bench/offline.py as it is
    runs = [run_one(args, tp, extra) for tp in args.tp]
    keep = ("tensor_parallel_size", "throughput_tok_s", "output_tokens", "seconds", "steps",
            "ms_per_step", "load_s", "num_kv_blocks", "cuda_graphs", "device",
            "triton_compiles_in_timed_run", "error", "tail", "returncode")
    summary = {"shape": args.shape, "num_seqs": args.num_seqs, "extra": extra,
               "runs": [{k: r[k] for k in keep if k in r} for r in runs]}
    base = runs[0].get("throughput_tok_s")
    for r in runs[1:]:
        if base and r.get("throughput_tok_s"):
            summary[f"ratio_tp{r['tensor_parallel_size']}_over_tp{args.tp[0]}"] = round(
                r["throughput_tok_s"] / base, 3)
    print(json.dumps(summary))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        name = f"tp-{args.shape}-{'-'.join(map(str, args.tp))}.json"
        with open(os.path.join(args.out, name), "w") as f:
            json.dump(summary, f, indent=1)
    ok = all("error" not in r and r.get("returncode") == 0 for r in runs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
