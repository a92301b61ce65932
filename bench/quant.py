"""Quantized weights on the GPU (docs/benchmarks.md, "Quantized weights"): in one process,

  1. copy bandwidth (2 GiB bf16 copy, read + write), the yardstick;
  2. the W4A16 GEMM (kernels/quant_matmul.py) at the Llama-3.1-8B projections (qkv, o,
     gate_up, down) and 1, 8, 32, 256, 2048 rows: every candidate tile config checked
     against the twin (kernels/reference.py) on that shape first (a wrong one is marked
     and never timed), then timed; achieved GB/s (quantized weight + scales + x + y) over
     the copy bandwidth, against torch's bf16 GEMM (F.linear) on the same shape, and the
     dequantize + cuBLAS path at the larger rows; W8A16 (GGUF Q8_0's layout) at 1 and 32;
  3. the engine decoding at 1, 8, 32 and 256 sequences (128-token prompts), Llama-3.1-8B
     shape, random weights: bf16 against int4 (GPTQ sym, group 128), tok/s and ms/step,
     and each one's weight memory.

The per-shape best configs against ``choose``'s pick say which tiles to keep
(kernels/quant_matmul.py ``choose``) and from how many rows the dense path pays
(DENSE_MIN_ROWS). Prints compact tables; writes DIR/quant-<time>.json (DIR: --out, else
$OUT, else bench/results).

  python bench/quant.py [--out DIR] [--quick] [--skip-engine] [--smoke]

--smoke: this script on the CPU (TRITON_INTERPRET=1, tiny shapes, the engine on a tiny
model): its numbers mean nothing. Budget on the H200: under 5 minutes on an empty Triton
cache (each config compiles once; M, N, K are not specialised).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
import traceback

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if not __package__:  # run as a script: bench/ is sys.path[0]
    sys.modules.pop("kernels", None)
import pagedq.kernels.quant_matmul as qm  # noqa: E402
from pagedq.kernels import quant_layout, reference  # noqa: E402

DEV = "cpu" if SMOKE else "cuda"
DT = torch.bfloat16
T0 = time.perf_counter()
# Llama-3.1-8B's projections: name -> (K, N) of W [K, N]
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
ROWS = (1, 8, 32, 256, 2048)
# the interleaved tiles (unpack=2) first: a sweep cut short by --sweep-budget still times them
DECODE = [qm.Config(16, 64, 128, unpack=2), qm.Config(16, 128, 128, unpack=2),
          qm.Config(16, 64, 256, unpack=2), qm.Config(16, 32, 128, unpack=2),
          qm.Config(16, 128, 256, warps=8, unpack=2), qm.Config(32, 64, 128, unpack=2),
          qm.Config(16, 64, 128), qm.Config(16, 64, 128, unpack=1),
          qm.Config(16, 64, 128, magic=0), qm.Config(16, 128, 128),
          qm.Config(16, 128, 128, unpack=1), qm.Config(16, 32, 128, stages=4),
          qm.Config(16, 64, 256, unpack=1), qm.Config(16, 128, 256, warps=8, unpack=1),
          qm.Config(16, 64, 128, stages=4), qm.Config(16, 64, 128, warps=2),
          qm.Config(32, 64, 128), qm.Config(32, 128, 128, unpack=1)]
PREFILL = [qm.Config(64, 128, 128, split=1, unpack=2),
           qm.Config(128, 128, 128, split=1, warps=8, unpack=2),
           qm.Config(64, 128, 64, split=1), qm.Config(128, 128, 64, split=1, warps=8),
           qm.Config(128, 256, 64, split=1, warps=8),
           qm.Config(128, 128, 128, split=1, warps=8, stages=2),
           qm.Config(64, 128, 128, split=1, unpack=1),
           qm.Config(128, 128, 64, split=1, warps=8, unpack=1)]
if SMOKE:
    SHAPES, ROWS = {"a": (256, 96), "b": (512, 64)}, (1, 5, 40)
    DECODE, PREFILL = DECODE[:2], PREFILL[:1]


SWEEP_DEADLINE = [float("inf")]  # candidates after it are skipped (defaults still timed)


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f} s] {msg}", flush=True)


def bench(fn, rep: int = 40) -> float:
    """Median microseconds."""
    if SMOKE:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    from triton.testing import do_bench
    return do_bench(fn, warmup=10, rep=rep, return_mode="median") * 1e3


def copy_bandwidth() -> float:
    n = 1 << (16 if SMOKE else 30)
    x = torch.randn(n, device=DEV, dtype=DT)
    y = torch.empty_like(x)
    us = bench(lambda: y.copy_(x), rep=100)
    return 2 * n * x.element_size() / us / 1e3  # GB/s, read + write


def weight(k: int, n: int, bits: int = 4, group: int = 128, asym: bool = False):
    """Random codes and scales in the layout: (qweight, scales, offsets, zero_point)."""
    p = 32 // bits
    q = torch.randint(-2**31, 2**31, (k // p, n), device=DEV, dtype=torch.int64).to(torch.int32)
    half = 1 << (bits - 1)
    s = (torch.rand(-(-k // group), n, device=DEV) * 0.02 / half + 0.01 / half).half()
    o = (-half * s.float()) if asym else None
    return q, s, o, (0 if asym else half)


def nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def relerr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm()) if torch.isfinite(a).all() else float("inf")


def gemm_point(name: str, k: int, n: int, m: int, copy_bw: float, bits: int = 4,
               group: int = 128, asym: bool = False, candidates=None) -> dict:
    q, s, o, zp = weight(k, n, bits, group, asym)
    x = torch.randn(m, k, device=DEV, dtype=DT)
    ref = reference.quant_matmul(x, q, s, o, bits, group, zp)
    qbytes = nbytes(q, s, o)
    sms = qm.num_sms(x.device)
    default = qm.choose(m, n, k, group, sms)
    row = dict(shape=name, K=k, N=n, M=m, bits=bits, group=group, asym=asym,
               weight_bytes=qbytes, default=default.name, configs={})
    dense = quant_layout.dequantize(q, s, o, bits, group, zp).to(DT).t().contiguous()  # [N, K]
    row["bf16_us"] = bench(lambda: F.linear(x, dense))
    row["bf16_GBps"] = (nbytes(dense, x) + m * n * 2) / row["bf16_us"] / 1e3
    tried = [default] + [qm.fitted(c, m, n, k, group, sms) for c in (candidates or [])]
    if candidates and default.block_m <= 32:  # the split, around the grid heuristic's
        tried += [dataclasses.replace(default, split=sp) for sp in (default.split // 2,
                                                           default.split * 2) if 1 <= sp <= 32]
    for cfg in tried:
        if cfg.name in row["configs"]:
            continue
        if cfg is not default and time.perf_counter() > SWEEP_DEADLINE[0]:
            row["configs"][cfg.name] = dict(skipped="past --sweep-budget")
            continue
        try:
            y = qm.quant_matmul(x, q, s, o, bits, group, zp, config=cfg)
            err = relerr(y, ref)
        except Exception as e:  # a config Triton cannot build here: reported, not fatal
            row["configs"][cfg.name] = dict(error=f"{type(e).__name__}: {str(e)[:200]}")
            continue
        entry = dict(relerr=err)
        if err < 2e-2:
            us = bench(lambda cfg=cfg: qm.quant_matmul(x, q, s, o, bits, group, zp, config=cfg))
            entry.update(us=us, GBps=(qbytes + nbytes(x) + m * n * 2) / us / 1e3)
            entry["of_copy"] = entry["GBps"] / copy_bw
        else:
            entry["wrong"] = True
        row["configs"][cfg.name] = entry
    if m >= 256:
        y = qm.dense_matmul(x, q, s, o, bits, group, zp)
        row["dense_relerr"] = relerr(y, ref)
        row["dense_us"] = bench(lambda: qm.dense_matmul(x, q, s, o, bits, group, zp))
    timed = {c: e for c, e in row["configs"].items() if "us" in e}
    if timed:
        best = min(timed, key=lambda c: timed[c]["us"])
        row.update(best=best, best_us=timed[best]["us"], best_GBps=timed[best]["GBps"],
                   best_of_copy=timed[best]["of_copy"])
    if default.name in timed:
        row.update(default_us=timed[default.name]["us"],
                   default_of_copy=timed[default.name]["of_copy"])
    return row


def gemms(copy_bw: float, quick: bool) -> list[dict]:
    rows = []
    for m in ROWS:
        cands = DECODE if m <= 32 else PREFILL
        for name, (k, n) in SHAPES.items():
            rows.append(gemm_point(name, k, n, m, copy_bw,
                                   candidates=None if quick and name != "gate_up" else cands))
            r = rows[-1]
            log(f"W4 {name:7s} M={m:5d}: bf16 {r['bf16_us']:8.1f} us | int4 "
                f"{r.get('default_us', float('nan')):8.1f} us ({r['default']}) best "
                f"{r.get('best_us', float('nan')):8.1f} us {r.get('best', '-')}")
    big = "gate_up" if "gate_up" in SHAPES else next(iter(SHAPES))
    for m in ROWS[:1] + ROWS[2:3]:
        k, n = SHAPES[big]
        rows.append(gemm_point(big, k, n, m, copy_bw, asym=True))  # AWQ / GPTQ asym
        rows.append(gemm_point(big, k, n, m, copy_bw, bits=8, group=32))  # GGUF Q8_0
        for r in rows[-2:]:
            log(f"W{r['bits']} {'asym' if r['asym'] else 'sym'} {big} M={m}: "
                f"{r.get('default_us', float('nan')):.1f} us, "
                f"{r.get('default_of_copy', float('nan')):.2f} of copy")
    return rows


def tune(rows: list[dict]) -> dict[str, str]:
    """kernels/quant_matmul.TUNED from the sweep (the fastest correct config of each
    measured shape and row bucket, int4 sym g128): the engine run uses it."""
    table = {}
    for r in rows:
        if r["bits"] == 4 and not r["asym"] and "best" in r and qm.row_bucket(r["M"]):
            cfg = config_of(r["best"])
            qm.TUNED[(qm.row_bucket(r["M"]), r["N"], r["K"])] = cfg
            table[f"{qm.row_bucket(r['M'])},{r['N']},{r['K']}"] = cfg.name
    return table


def config_of(name: str) -> qm.Config:
    """Config.name -> Config (m16n64k128s4w4st3u1g1)."""
    import re
    f = [int(v) for v in re.fullmatch(r"m(\d+)n(\d+)k(\d+)s(\d+)w(\d+)st(\d+)u(\d+)g(\d+)",
                                      name).groups()]
    return qm.Config(*f)


def engine_folder(quantized: bool, smoke: bool) -> str:
    import tempfile

    from bench.offline import SHAPES as MODEL_SHAPES
    shape = dict(MODEL_SHAPES["tiny" if smoke else "llama-3.1-8b"])
    cfg = dict(shape, rms_norm_eps=1e-5, hidden_act="silu", torch_dtype="bfloat16",
               eos_token_id=0, bos_token_id=0)
    if quantized:
        cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32
                                      if smoke else 128, "sym": True, "desc_act": False}
    folder = tempfile.mkdtemp(prefix="pagedq-quant-")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    return folder


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def decode_rate(engine, batch: int, steps: int, prompt_len: int) -> dict:
    from pagedq.engine import SamplingParams
    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=steps + 16)
    ids = [f"d{batch}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, torch.randint(1, 10000, (prompt_len,), generator=g).tolist(),
                           params)
    produced: dict[str, int] = {}
    while len(produced) < batch or min(produced.values()) < 2:  # prefills, then 2 decodes
        for out in engine.step():
            produced[out.request_id] = produced.get(out.request_id, 0) + 1
    sync()
    t = time.perf_counter()
    tokens = 0
    for _ in range(steps):
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    sync()
    dt = time.perf_counter() - t
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished():
        engine.step()
    return dict(batch=batch, steps=steps, tokens=tokens, seconds=dt, tok_s=tokens / dt,
                ms_per_step=dt / steps * 1e3)


def engines(smoke: bool, steps: int) -> dict:
    from pagedq.engine import LLMEngine
    from pagedq.engine.quant.model import weight_bytes
    batches = (1, 2, 4) if smoke else (1, 8, 32, 256)
    prompt_len = 16 if smoke else 128
    out = {}
    for kind in ("bf16", "int4"):
        t = time.perf_counter()
        if DEV == "cuda":
            torch.cuda.empty_cache()
            before = torch.cuda.memory_allocated()
        seq_len = prompt_len + steps + 32  # prompt, warm-up and timed steps, slack
        engine = LLMEngine(engine_folder(kind == "int4", smoke), load_format="dummy",
                           device=DEV, dtype="bfloat16", max_model_len=seq_len,
                           max_num_seqs=max(batches), max_num_batched_tokens=2048,
                           num_kv_blocks=max(batches) * -(-seq_len // 16) + 1)
        model = engine.runner.model
        res = dict(load_s=time.perf_counter() - t, weight_bytes=weight_bytes(model),
                   summary=engine.runner.quant_summary, rates=[])
        if DEV == "cuda":
            res["allocated_bytes"] = torch.cuda.memory_allocated() - before
            res["kv_bytes"] = engine.runner.kv_cache_bytes
        log(f"engine {kind}: loaded in {res['load_s']:.1f} s, weights "
            f"{res['weight_bytes'] / 2**30:.2f} GiB ({res['summary'] or 'bf16'})")
        for b in batches:
            r = decode_rate(engine, b, steps, prompt_len)
            res["rates"].append(r)
            log(f"engine {kind}: {b:3d} seqs {r['tok_s']:9.0f} tok/s {r['ms_per_step']:6.2f} ms/step")
        out[kind] = res
        engine.runner.release_graphs()  # (their pools hold device memory)
        engine.runner.close()
        del engine, model
        gc.collect()
    return out


def tables(res: dict) -> str:
    lines = [f"copy bandwidth {res['copy_GBps']:.0f} GB/s (read + write); int4 = GPTQ sym g128"]
    lines.append(f"{'shape':8s} {'M':>5s} {'bf16 us':>8s} {'int4 us':>8s} {'x bf16':>7s} "
                 f"{'GB/s':>6s} {'/copy':>6s} {'best us':>8s} {'/copy':>6s}  best config "
                 f"(default)  dense us")
    for r in res.get("gemm", []):
        if r["bits"] != 4 or r["asym"]:
            continue
        d, b = r.get("default_us", float("nan")), r.get("best_us", float("nan"))
        gb = r["configs"].get(r["default"], {}).get("GBps", float("nan"))
        lines.append(f"{r['shape']:8s} {r['M']:5d} {r['bf16_us']:8.1f} {d:8.1f} "
                     f"{r['bf16_us'] / d:7.2f} {gb:6.0f} {r.get('default_of_copy', 0):6.2f} "
                     f"{b:8.1f} {r.get('best_of_copy', 0):6.2f}  {r.get('best', '-')} "
                     f"({r['default']})  {r.get('dense_us', float('nan')):.1f}")
    for r in res.get("gemm", []):
        if r["bits"] == 8 or r["asym"]:
            lines.append(f"W{r['bits']}{' asym' if r['asym'] else ''} g{r['group']} "
                         f"{r['shape']} M={r['M']}: {r.get('default_us', float('nan')):.1f} us "
                         f"({r.get('default_of_copy', float('nan')):.2f} of copy), bf16 "
                         f"{r['bf16_us']:.1f} us")
    if res.get("tuned"):
        lines.append("tuned tiles (row bucket, N, K -> config; the engine's int4 run used "
                     "them): " + "; ".join(f"{k} {v}" for k, v in res["tuned"].items()))
    dense = [(r["shape"], r["M"], r["dense_us"], r.get("best_us")) for r in res.get("gemm", [])
             if "dense_us" in r]
    if dense:
        lines.append("dequantize + cuBLAS vs best fused (us): " + "; ".join(
            f"{sh} M={m} {d:.0f} vs {b or float('nan'):.0f}" for sh, m, d, b in dense))
    eng = res.get("engine")
    if eng and "bf16" in eng and "int4" in eng:
        lines.append(f"engine decode, Llama-3.1-8B shape: weights bf16 "
                     f"{eng['bf16']['weight_bytes'] / 2**30:.2f} GiB, int4 "
                     f"{eng['int4']['weight_bytes'] / 2**30:.2f} GiB")
        lines.append(f"{'seqs':>5s} {'bf16 tok/s':>11s} {'ms/step':>8s} {'int4 tok/s':>11s} "
                     f"{'ms/step':>8s} {'int4/bf16':>9s}")
        for a, b in zip(eng["bf16"]["rates"], eng["int4"]["rates"], strict=True):
            lines.append(f"{a['batch']:5d} {a['tok_s']:11.0f} {a['ms_per_step']:8.2f} "
                         f"{b['tok_s']:11.0f} {b['ms_per_step']:8.2f} "
                         f"{b['tok_s'] / a['tok_s']:9.2f}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true",
                    help="candidate configs on gate_up only (the others: the default)")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--steps", type=int, default=48, help="timed decode steps per batch")
    ap.add_argument("--smoke", action="store_true", help="CPU check of this script")
    ap.add_argument("--sweep-budget", type=float, default=240.0,
                    help="seconds from the start after which the GEMM sweep times only the "
                         "default configs (compiles on an empty cache are most of it)")
    args = ap.parse_args()
    SWEEP_DEADLINE[0] = T0 + args.sweep_budget
    if not SMOKE and not torch.cuda.is_available():
        ap.error("needs CUDA (or --smoke)")
    res: dict = dict(device=torch.cuda.get_device_name() if DEV == "cuda" else "cpu",
                     torch=torch.__version__, smoke=SMOKE)
    import triton
    res["triton"] = triton.__version__
    res["copy_GBps"] = copy_bandwidth()
    log(f"copy bandwidth {res['copy_GBps']:.0f} GB/s")
    out = args.out or os.environ.get("OUT") or os.path.join(os.path.dirname(
        os.path.abspath(__file__)), "results")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"quant-{time.strftime('%Y%m%d-%H%M%S')}.json")
    for part, fn in (("gemm", lambda: gemms(res["copy_GBps"], args.quick)),
                     ("tuned", lambda: tune(res.get("gemm", []))),
                     ("engine", lambda: None if args.skip_engine else
                      engines(SMOKE, 4 if SMOKE else args.steps))):
        try:
            res[part] = fn()
        except Exception as e:  # report what ran; the rest of the figures still print
            res[f"{part}_error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        res["seconds"] = time.perf_counter() - T0
        with open(path, "w") as f:  # after every part: a run cut short keeps what it had
            json.dump(res, f, indent=1)
        if part == "gemm":
            print(tables(res), flush=True)
    print(tables(res), flush=True)
    log(f"wrote {path}")
    return 1 if any(k.endswith("_error") for k in res) else 0


if __name__ == "__main__":
    sys.exit(main())
