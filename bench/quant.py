"""Quantized weights on the GPU (docs/benchmarks.md, "Quantized weights"): in one process,

  1. copy bandwidth (2 GiB bf16 copy, read + write), the yardstick;
  2. the W4A16 GEMM at the Llama-3.1-8B projections (qkv, o, gate_up, down) and 1, 8, 16, 32,
     256 rows: every kernel checked against the twin (kernels/reference.py) on that shape
     first (a wrong one is marked and never timed), then timed with its weights rotated over
     more than ROTATE_BYTES (several times the H200's 60 MB L2, so every call reads its
     weights from memory), each call one launch in a captured CUDA graph (the engine's
     decode runs in graphs too): bf16 F.linear on bf16 copies of the same weights; torch's
     own int4 kernel (aten._weight_int4pack_mm, "tinygemm", group 128, the kernel torchao
     and gpt-fast use), the yardstick a user already has; kernels/quant_decode.py's plans
     (GEMV for one row, DOT for more); kernels/quant_matmul.py's tiles; dequantize + cuBLAS
     from 256 rows; and "auto", what quant_matmul picks (what the engine runs). Achieved GB/s
     counts the quantized weight + scales + x + y once per call; "/copy" is that over 1.
     W8A16 (GGUF Q8_0's layout, and GPTQ 8-bit's) and int4 with offsets (AWQ / GPTQ asym)
     at one row beside it;
  3. the engine decoding at 1, 8, 32 and 256 sequences (128-token prompts), Llama-3.1-8B
     shape, random weights: bf16 against int4 (GPTQ sym, group 128), tok/s and ms/step,
     and each one's weight memory; the fastest correct decode plan of each measured shape
     is put in quant_decode.TUNED first.

Prints compact tables; writes DIR/quant-<time>.json (DIR: --out, else $OUT, else
bench/results).

  python bench/quant.py [--out DIR] [--quick] [--skip-engine] [--smoke]

--smoke: this script on the CPU (TRITON_INTERPRET=1, tiny shapes, the engine on a tiny
model, eager timing): its numbers mean nothing. Budget on the H200: under 6 minutes on an
empty Triton cache.
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
import pagedq.kernels.quant_matmul as qm  # noqa: E402
from pagedq.kernels import quant_decode as qd  # noqa: E402
from pagedq.kernels import quant_layout, reference  # noqa: E402
from pagedq.kernels import quant_rows as qr  # noqa: E402

DEV = "cpu" if SMOKE else "cuda"
DT = torch.bfloat16
T0 = time.perf_counter()
# Llama-3.1-8B's projections: name -> (K, N) of W [K, N]
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
ROWS = (1, 8, 16, 32, 256)
ROTATE_BYTES = 400 << 20  # > 6x the H200's L2
# the few-rows plans timed beside quant_decode.plan's pick (splits: fitted to the grid)
GEMV = [qd.Plan(False, 512, 8, 0), qd.Plan(False, 512, 4, 0), qd.Plan(False, 256, 8, 0, warps=2),
        qd.Plan(False, 256, 4, 0, warps=2), qd.Plan(False, 128, 8, 0, warps=1),
        qd.Plan(False, 128, 4, 0, warps=1), qd.Plan(False, 512, 8, 0, prefetch=False)]
DOT = [qd.Plan(True, 64, 16, 0), qd.Plan(True, 128, 16, 0, warps=8),
       qd.Plan(True, 64, 16, 0, warps=8), qd.Plan(True, 256, 16, 0, warps=8)]
# the rows GEMV (kernels/quant_rows.py), timed at 2..8 rows beside the DOT tiles
ROWS_GEMV = [qd.Plan(False, 512, 1, 0), qd.Plan(False, 256, 1, 0, warps=2),
             qd.Plan(False, 1024, 1, 0, warps=8), qd.Plan(False, 512, 1, 0, prefetch=False)]
# quant_matmul's tiles timed at 32 rows (docs/benchmarks.md's earlier winners there)
TILES_32 = [qm.Config(32, 128, 128, split=2, unpack=1), qm.Config(32, 128, 128, split=16, unpack=1),
            qm.Config(16, 32, 128, split=1, stages=4), qm.Config(32, 128, 128, unpack=1)]
if SMOKE:
    SHAPES, ROWS, ROTATE_BYTES = {"a": (256, 96), "b": (512, 64)}, (1, 5, 40), 1 << 16
    GEMV, DOT, ROWS_GEMV = GEMV[:2], DOT[:1], ROWS_GEMV[:1]


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f} s] {msg}", flush=True)


def copy_bandwidth() -> float:
    n = 1 << (16 if SMOKE else 30)
    x = torch.randn(n, device=DEV, dtype=DT)
    y = torch.empty_like(x)
    for _ in range(1 if SMOKE else 200):  # clocks up from idle first (~0.2 s of copies)
        y.copy_(x)
    if SMOKE:
        return 2 * n * x.element_size() / per_call_us([lambda: y.copy_(x)]) / 1e3
    # not in a graph: there a copy becomes a copy-engine node (2.76 TB/s on the H200, against
    # 4.25 TB/s for the SMs' copy that kernels compete with)
    from triton.testing import do_bench
    us = do_bench(lambda: y.copy_(x), warmup=25, rep=200, return_mode="median") * 1e3
    return 2 * n * x.element_size() / us / 1e3  # GB/s, read + write


def per_call_us(calls: list, reps: int = 10) -> float:
    """Median microseconds per call of ``calls`` (one call per weight copy), replayed as
    one CUDA graph (CPU: eager, wall clock)."""
    if SMOKE:
        t = time.perf_counter()
        for c in calls:
            c()
        return (time.perf_counter() - t) * 1e6 / len(calls)
    for c in calls[:2]:  # compile, allocate
        c()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls[:2]:
            c()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(calls))
    del graph
    return sorted(times)[len(times) // 2]


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


def copies_for(one_bytes: int) -> int:
    return max(2, -(-ROTATE_BYTES // max(one_bytes, 1)))


def tinygemm_weights(k: int, n: int, group: int, count: int):
    """Random weights in aten._weight_int4pack_mm's packed form, or None where this torch
    lacks it (its signature changed across releases)."""
    try:
        out = []
        for _ in range(count):
            w = torch.randint(0, 256, (n, k // 2), device=DEV, dtype=torch.uint8)
            packed = torch.ops.aten._convert_weight_to_int4pack(w, 8)
            sz = torch.rand(k // group, n, 2, device=DEV, dtype=DT) * 0.01
            out.append((packed, sz))
        return out
    except Exception as e:  # reported beside the table
        return f"{type(e).__name__}: {str(e)[:160]}"


def gemm_point(name: str, k: int, n: int, m: int, copy_bw: float, bits: int = 4,
               group: int = 128, asym: bool = False, sweep: bool = True) -> dict:
    base = weight(k, n, bits, group, asym)
    zp = base[3]
    qbytes = nbytes(*base[:3])
    ws = [base] + [weight(k, n, bits, group, asym) for _ in range(copies_for(qbytes) - 1)]
    x = torch.randn(m, k, device=DEV, dtype=DT)
    io = nbytes(x) + m * n * 2
    ref = reference.quant_matmul(x, *base[:3], bits, group, zp)
    row = dict(shape=name, K=k, N=n, M=m, bits=bits, group=group, asym=asym,
               weight_bytes=qbytes, copies=len(ws), kernels={})
    sms = qd.num_sms(x.device)

    def timed(label, fn, check=None, wbytes=qbytes, copies=ws):
        try:
            err = relerr(fn(copies[0]), ref) if check is None else check
        except Exception as e:  # a plan Triton cannot build here: reported, not fatal
            row["kernels"][label] = dict(error=f"{type(e).__name__}: {str(e)[:200]}")
            return
        entry = dict(relerr=err)
        if err < 2e-2:
            us = per_call_us([lambda c=c: fn(c) for c in copies])
            entry.update(us=us, GBps=(wbytes + io) / us / 1e3)
            entry["of_copy"] = entry["GBps"] / copy_bw
        else:
            entry["wrong"] = True
        row["kernels"][label] = entry

    dense = [quant_layout.dequantize(*w[:3], bits, group, zp).to(DT).t().contiguous()
             for w in ws[:1]]
    err = relerr(F.linear(x, dense[0]), ref)
    dbytes = nbytes(dense[0])
    dense += [torch.randn_like(dense[0]) for _ in range(copies_for(dbytes) - 1)]
    timed("bf16", lambda w: F.linear(x, w), check=err, wbytes=dbytes, copies=dense)
    del dense
    if bits == 4 and not asym and not SMOKE and m <= 32:
        tg = tinygemm_weights(k, n, group, copies_for(qbytes))
        if isinstance(tg, str):
            row["kernels"]["tinygemm"] = dict(error=tg)
        else:  # its own random weights: timed, not checked against ours
            timed("tinygemm", lambda w: torch.ops.aten._weight_int4pack_mm(x, w[0], group, w[1]),
                  check=0.0, wbytes=nbytes(*tg[0]), copies=tg)
    run = lambda w, **kw: qm.quant_matmul(x, *w[:3], bits, group, zp, **kw)  # noqa: E731
    timed("auto", run)
    if m <= qd.MAX_ROWS and qd.serves(m, bits, group):
        plans = [qd.plan(m, n, k, bits, sms)]
        if sweep:
            few = GEMV if m == 1 else DOT + (ROWS_GEMV if m <= qr.MAX_ROWS else [])
            plans += [qd.fit_splits(p, n, k, bits, sms) for p in few]
            plans += [dataclasses.replace(plans[0], splits=sp) for sp in  # around the grid rule
                      (plans[0].splits // 2, plans[0].splits * 2) if sp >= 1]
        for p in dict.fromkeys(plans):
            timed(f"decode:{p.name}", lambda w, p=p: qd.decode_matmul(x, *w[:3], bits, group, zp,
                                                                      p=p))
    tiles = [qm.choose(m, n, k, group, sms)]
    if sweep and m > qd.MAX_ROWS and m <= 32:  # the tiles that won at 32 rows before
        tiles += [qm.fitted(c, m, n, k, group, sms) for c in TILES_32]
    for cfg in dict.fromkeys(tiles):
        timed(f"tiles:{cfg.name}", lambda w, cfg=cfg: run(w, config=cfg))
    if m >= 256:
        timed("dense", lambda w: qm.dense_matmul(x, *w[:3], bits, group, zp))
    quant = {lab: e for lab, e in row["kernels"].items() if "us" in e
             and lab not in ("bf16", "tinygemm")}
    if quant:
        best = min(quant, key=lambda lab: quant[lab]["us"])
        row.update(best=best, best_us=quant[best]["us"], best_of_copy=quant[best]["of_copy"])
    del ws
    return row


def us_of(r: dict, label: str) -> float:
    return r["kernels"].get(label, {}).get("us", float("nan"))


def gemms(copy_bw: float, quick: bool) -> list[dict]:
    rows = []
    for m in ROWS:
        for name, (k, n) in SHAPES.items():
            rows.append(gemm_point(name, k, n, m, copy_bw, sweep=not quick or m in (1, 32)))
            r = rows[-1]
            log(f"W4 {name:7s} M={m:4d}: bf16 {us_of(r, 'bf16'):7.1f} us | tinygemm "
                f"{us_of(r, 'tinygemm'):7.1f} | auto {us_of(r, 'auto'):7.1f} | best "
                f"{r.get('best_us', float('nan')):7.1f} {r.get('best', '-')}")
    big = "gate_up" if "gate_up" in SHAPES else next(iter(SHAPES))
    k, n = SHAPES[big]
    for m in ROWS[:1] + ROWS[1:2]:
        rows.append(gemm_point(big, k, n, m, copy_bw, asym=True, sweep=False))  # AWQ / asym
        rows.append(gemm_point(big, k, n, m, copy_bw, bits=8, group=32, sweep=m == 1))  # Q8_0
        rows.append(gemm_point(big, k, n, m, copy_bw, bits=8, group=128, sweep=False))  # GPTQ 8
        for r in rows[-3:]:
            log(f"W{r['bits']} g{r['group']}{' asym' if r['asym'] else ''} {big} M={m}: auto "
                f"{us_of(r, 'auto'):.1f} us, bf16 {us_of(r, 'bf16'):.1f} us")
    return rows


def tune(rows: list[dict]) -> dict[str, str]:
    """quant_decode.TUNED from the sweep (the fastest correct plan of each measured shape,
    row bucket and width, sym codes), and quant_matmul.TUNED's tiles for the rows past it:
    the engine run uses them."""
    table = {}
    for r in rows:
        if r["asym"]:
            continue
        if r["M"] > qd.MAX_ROWS:
            timed = {lab: e["us"] for lab, e in r["kernels"].items()
                     if lab.startswith("tiles:") and "us" in e}
            if timed and r["bits"] == 4 and qm.row_bucket(r["M"]) == 32:
                best = min(timed, key=timed.get)
                qm.TUNED[(32, r["N"], r["K"])] = config_of(best.split(":", 1)[1])
                table[f"32,{r['N']},{r['K']},tiles"] = best
            continue
        timed = {lab: e["us"] for lab, e in r["kernels"].items()
                 if lab.startswith("decode:") and "us" in e}
        if not timed:
            continue
        best = min(timed, key=timed.get)
        key = (qd.row_bucket(r["M"]), r["N"], r["K"], r["bits"])
        qd.TUNED[key] = plan_of(best.split(":", 1)[1])
        table[",".join(map(str, key))] = best
    return table


def config_of(name: str) -> qm.Config:
    """Config.name -> Config (m16n64k128s4w4st3u1g1)."""
    import re
    f = [int(v) for v in re.fullmatch(r"m(\d+)n(\d+)k(\d+)s(\d+)w(\d+)st(\d+)u(\d+)g(\d+)",
                                      name).groups()]
    return qm.Config(*f)


def plan_of(name: str) -> qd.Plan:
    """Plan.name -> Plan (gemv-n512kp8s4w4st1p)."""
    import re
    kind, bn, kp, sp, w, st, pf = re.fullmatch(r"(gemv|dot)-n(\d+)kp(\d+)s(\d+)w(\d+)st(\d+)(p?)",
                                              name).groups()
    return qd.Plan(kind == "dot", int(bn), int(kp), int(sp), int(w), int(st), pf == "p")


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
    lines = [f"copy bandwidth {res['copy_GBps']:.0f} GB/s (read + write); int4 = GPTQ sym g128; "
             "us per call, weights rotated, in CUDA graphs; x: over bf16's time"]
    lines.append(f"{'shape':8s} {'M':>4s} {'bf16':>7s} {'tinygemm':>8s} {'x':>5s} {'auto':>7s} "
                 f"{'x':>5s} {'/copy':>6s} {'best':>7s} {'/copy':>6s}  best kernel")
    for r in res.get("gemm", []):
        if r["bits"] != 4 or r["asym"]:
            continue
        b, t, a = us_of(r, "bf16"), us_of(r, "tinygemm"), us_of(r, "auto")
        ac = r["kernels"].get("auto", {}).get("of_copy", float("nan"))
        lines.append(f"{r['shape']:8s} {r['M']:4d} {b:7.1f} {t:8.1f} {b / t:5.2f} {a:7.1f} "
                     f"{b / a:5.2f} {ac:6.2f} {r.get('best_us', float('nan')):7.1f} "
                     f"{r.get('best_of_copy', float('nan')):6.2f}  {r.get('best', '-')}")
    for r in res.get("gemm", []):
        if r["bits"] == 8 or r["asym"]:
            a = us_of(r, "auto")
            lines.append(f"W{r['bits']}{' asym' if r['asym'] else ''} g{r['group']} "
                         f"{r['shape']} M={r['M']}: auto {a:.1f} us "
                         f"({r['kernels'].get('auto', {}).get('of_copy', float('nan')):.2f} of "
                         f"copy), bf16 {us_of(r, 'bf16'):.1f} us: x{us_of(r, 'bf16') / a:.2f}; "
                         f"best {r.get('best', '-')} {r.get('best_us', float('nan')):.1f} us")
    if res.get("tuned"):
        lines.append("tuned plans (row bucket, N, K, bits -> plan; the engine's int4 run used "
                     "them): " + "; ".join(f"{k} {v}" for k, v in res["tuned"].items()))
    errors = {f"{r['shape']} M={r['M']} {lab}": e["error"] for r in res.get("gemm", [])
              for lab, e in r["kernels"].items() if "error" in e}
    wrong = [f"{r['shape']} M={r['M']} {lab}" for r in res.get("gemm", [])
             for lab, e in r["kernels"].items() if e.get("wrong")]
    if errors:
        lines.append(f"errors: {dict(list(errors.items())[:4])}")
    if wrong:
        lines.append(f"WRONG (not timed): {wrong}")
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
                    help="the plan sweep at one row only (more rows: the default plan)")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--steps", type=int, default=48, help="timed decode steps per batch")
    ap.add_argument("--smoke", action="store_true", help="CPU check of this script")
    args = ap.parse_args()
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
