"""Paged decode attention: achieved KV-read GB/s vs copy bandwidth and vs torch SDPA on the
same data laid out contiguously (docs/benchmarks.md, Definitions 3). CUDA only.

    PYTHONPATH=. python bench/attention.py [--out DIR] [--sweep] [--fp8-sweep] [--quick]
                                          [--kv-dtypes fp8,fp8_e5m2,int8] [--dry-run]

8-bit caches (always, each of --kv-dtypes): paged_decode_attention as the engine runs it (its
DEFAULTS variant for the kind, V transposed; fp8 e4m3 with per-head scale tensors, int8 with
its scale caches) at B=64 x L=4096 and B=256 x L=1024 (16/8 heads), against the bf16
cache's default on the same data: GB/s of the bytes read (int8's scales included) and their
share of copy bandwidth (issue 40's bar: >= 0.85).
--fp8-sweep: the same target points with each 8-bit cache of --kv-dtypes, over the
kernel's knobs; time against the bf16 cache's default config on the same data.

--dry-run: a smoke test of this script on the CPU (Triton interpreter, tiny shapes, wall
clock): its numbers mean nothing.

KV bytes per call = B * L * Hkv * D * 2 (K and V) * elem size; both paths read the same
bytes. Each timed call takes the next of several input sets when one set fits in L2 (and
do_bench flushes L2 between calls anyway). Prints a table last; writes JSON to
DIR/attention-<timestamp>.json (DIR defaults to bench/results).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

DRY = "--dry-run" in sys.argv
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

if not __package__:  # run as a script: the checkout's root, not bench/, leads sys.path
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from pagedq.kernels import kv_quant  # noqa: E402
from pagedq.kernels.decode_attention import (  # noqa: E402
    choose_num_splits,
    decode_launch,
    paged_decode_attention,
)
from pagedq.kernels.layout import transposed_view  # noqa: E402

BS, D, DT = 16, 128, torch.bfloat16
GRID_B, GRID_L = (1, 16, 64, 256), (512, 2048, 8192, 32768)
TARGETS = ((64, 4096), (16, 16384))  # the bar: paged >= 0.90 x SDPA GB/s
TARGETS8 = ((64, 4096), (256, 1024))  # issue 40's: 8-bit KV bytes read >= 0.85 x copy
KV8 = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8}
DEV = "cpu" if DRY else "cuda"
if DRY:
    GRID_B, GRID_L, TARGETS, DT = (1, 2), (32, 64), ((2, 64), (1, 128)), torch.float32
    TARGETS8 = ((2, 64),)
GQAS = ((16, 8), (32, 8))


def bench(fn, rep=100) -> float:
    """Median milliseconds."""
    if DRY:
        ts = []
        for _ in range(3):
            t = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t) * 1e3)
        return sorted(ts)[1]
    return do_bench(fn, warmup=rep // 4, rep=rep, return_mode="median")


def num_sms() -> int:
    return 16 if DRY else torch.cuda.get_device_properties(0).multi_processor_count


def copy_bandwidth() -> float:
    n = 1 << (16 if DRY else 30)  # 2 GiB of bf16 on the GPU
    x = torch.randn(n, device=DEV, dtype=DT)
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x))
    return 2 * n * x.element_size() / ms / 1e6  # GB/s, read + write


def sdpa_fn(q, k, v):
    """SDPA decode on contiguous [B, H, L, D]; flash first (native GQA), then the default."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for name, backends in (("flash", [SDPBackend.FLASH_ATTENTION]),
                           ("cudnn", [SDPBackend.CUDNN_ATTENTION]), ("default", None)):
        try:
            if backends is None:
                f = lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v,
                                                                        enable_gqa=True)
            else:
                def f(q=q, k=k, v=v, backends=backends):
                    with sdpa_kernel(backends):
                        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            f()
            if not DRY:
                torch.cuda.synchronize()
            return name, f
        except Exception:  # noqa: BLE001 - a backend that refuses these inputs
            continue
    raise RuntimeError("no SDPA backend ran")


class Point:
    """n_sets independent input sets for one (Hq, Hkv, B, L): a scrambled paged cache and
    the same K/V contiguous [B, Hkv, L, D] for SDPA."""

    def __init__(self, hq, hkv, B, L, n_sets):
        self.hq, self.hkv, self.B, self.L = hq, hkv, B, L
        nbps = L // BS
        nb = B * nbps * n_sets
        self.kc = torch.randn(nb, BS, hkv, D, device=DEV, dtype=DT)
        self.vc = torch.randn(nb, BS, hkv, D, device=DEV, dtype=DT)
        perm = torch.randperm(nb, device=DEV, dtype=torch.int64)
        self.sets = []
        for i in range(n_sets):
            bt = perm[i * B * nbps:(i + 1) * B * nbps].view(B, nbps)
            k = torch.empty(B, hkv, L, D, device=DEV, dtype=DT)
            v = torch.empty_like(k)
            for b in range(B):  # per sequence: no full-size gather temporary
                k[b] = self.kc[bt[b]].view(L, hkv, D).transpose(0, 1)
                v[b] = self.vc[bt[b]].view(L, hkv, D).transpose(0, 1)
            q = torch.randn(B, hq, D, device=DEV, dtype=DT)
            lens = torch.full((B,), L, device=DEV, dtype=torch.int32)
            self.sets.append((q, bt.to(torch.int32).contiguous(), lens, k, v))

    def paged(self, **knobs):
        it = itertools.cycle(self.sets)
        scale = D ** -0.5

        def f():
            q, bt, lens, _, _ = next(it)
            return decode_launch(q, self.kc, self.vc, bt, lens, scale, **knobs)
        return f

    def sdpa(self):
        fns = [sdpa_fn(q.unsqueeze(2), k, v) for q, _, _, k, v in self.sets]
        it = itertools.cycle(fns)
        return fns[0][0], lambda: next(it)[1]()


def kv_bytes(hkv, B, L) -> int:
    return B * L * hkv * D * 2 * 2


def make_point(hq, hkv, B, L, l2_bytes):
    nbytes = kv_bytes(hkv, B, L)
    free = 1 << 30 if DRY else torch.cuda.mem_get_info()[0]
    if 2.2 * nbytes > free:  # paged + contiguous copy + slack
        return None
    return Point(hq, hkv, B, L, min(16, max(1, triton.cdiv(4 * l2_bytes, nbytes))))


def run_point(p: Point | None, hq, hkv, B, L, sdpa=True, rep=100, **knobs):
    if p is None:
        return {"hq": hq, "hkv": hkv, "B": B, "L": L, "skipped": "memory"}
    nbytes = kv_bytes(hkv, B, L)
    out = p.paged(**knobs)()  # first set: compare with SDPA on the same data
    q, _, _, k, v = p.sets[0]
    backend, f = sdpa_fn(q.unsqueeze(2), k, v)
    ref = f().squeeze(2)
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    t_p = bench(p.paged(**knobs), rep)
    r = {"hq": hq, "hkv": hkv, "B": B, "L": L, "n_sets": len(p.sets),
         "splits": knobs.get("num_splits") or choose_num_splits(
             B, hkv, L, num_sms(), knobs.get("block_n") or 64),
         "paged_us": t_p * 1e3, "paged_GBps": nbytes / t_p / 1e6, "rel_err_vs_sdpa": err,
         **{k: v for k, v in knobs.items() if v is not None}}
    if sdpa:
        backend, g = p.sdpa()
        t_s = bench(g)
        r.update(sdpa_us=t_s * 1e3, sdpa_GBps=nbytes / t_s / 1e6, ratio=t_s / t_p,
                 sdpa_backend=backend)
    return r


def measure(hq, hkv, B, L, l2_bytes):
    p = make_point(hq, hkv, B, L, l2_bytes)
    r = run_point(p, hq, hkv, B, L)
    del p
    if not DRY:
        torch.cuda.empty_cache()
    return r


def fmt(r, copy_bw) -> str:
    head = f"{r['hq']:>2}/{r['hkv']:<2} {r['B']:>4} {r['L']:>6}"
    if "skipped" in r:
        return f"{head}  skipped ({r['skipped']})"
    s = (f"{head} {r['splits']:>4} {r['paged_us']:>9.1f} {r['paged_GBps']:>11.0f} "
         f"{r['paged_GBps'] / copy_bw:>6.2f}")
    if "sdpa_us" in r:
        s += f" {r['sdpa_us']:>9.1f} {r['sdpa_GBps']:>10.0f} {r['ratio']:>6.2f}"
    return s + f" {r['rel_err_vs_sdpa']:>8.1e}"


HEADER = (" GQA    B      L  spl  paged_us  paged_GB/s  /copy   sdpa_us  sdpa_GB/s  "
          "ratio  relerr")


def kv8(p: Point, kind: str):
    """The point's cache as an 8-bit cache of ``kind`` in the engine's layout (V transposed),
    its scale keywords (fp8 e4m3: per-head tensors, the engine's form) and KV bytes."""
    dt = KV8[kind]
    kc, ksc = kv_quant.quantized_cache(p.kc, dt)
    vc, vsc = kv_quant.quantized_cache(p.vc, dt)
    vt = transposed_view(torch.empty(vc.shape, dtype=dt, device=DEV))
    vt.view(torch.uint8).copy_(vc.view(torch.uint8))
    ones = torch.ones(p.hkv, device=DEV)
    kq = dict(k_scale_cache=ksc, v_scale_cache=vsc) if ksc is not None else \
        dict(k_scale=ones, v_scale=ones) if kind == "fp8" else {}
    per_token = D + (4 if ksc is not None else 0)  # bytes per token and head, K or V
    return kc, vc, vt, kq, p.B * p.L * p.hkv * per_token * 2


def timed_on(p: Point, kc, vc, kq, fn=paged_decode_attention, rep=40, **knobs) -> float:
    """Median us of ``fn`` over the point's sets on these caches."""
    it = itertools.cycle(p.sets)

    def f():
        q, bt, lens, _, _ = next(it)
        return fn(q, kc, vc, bt, lens, D ** -0.5, **kq, **knobs)
    return bench(f, rep) * 1e3


def measure8(p: Point, kind: str, copy_bw: float, bf16_us: float) -> dict:
    kc, _, vt, kq, nbytes = kv8(p, kind)
    q, bt, lens, _, _ = p.sets[0]
    ref = paged_decode_attention(q, p.kc, p.vc, bt, lens, D ** -0.5).float()
    err = (paged_decode_attention(q, kc, vt, bt, lens, D ** -0.5, **kq).float() - ref).norm()
    us = timed_on(p, kc, vt, kq, rep=100)
    return dict(kind=kind, B=p.B, L=p.L, us=us, GBps=nbytes / us / 1e3,
                of_copy=nbytes / us / 1e3 / copy_bw, bf16_us=bf16_us, x_bf16=bf16_us / us,
                relerr_vs_bf16_cache=(err / ref.norm()).item())


def fp8_sweep(p: Point, kind: str, deadline: float) -> list[dict]:
    """Decode on an 8-bit copy of the point's cache in the engine's layout (V transposed,
    kernels/layout.py): default knobs and a grid; "token-major V" is the default knobs on
    the layout the fp8 cache had before."""
    kc8, vc8_rows, vc8, kq, nbytes = kv8(p, kind)
    bf16_us, out = timed_on(p, p.kc, p.vc, {}, decode_launch), []
    grid = [{}, "token-major V"] + [dict(block_n=bn, num_warps=nw, num_stages=ns,
                                          num_splits=sp)
                                     for (bn, nw, ns), sp in itertools.product(
                                         ((64, 1, 2), (64, 1, 3), (64, 2, 2), (128, 2, 2),
                                          (128, 4, 2), (64, 4, 3)), (1, 2, 4, 8))]
    for knobs in grid:
        if time.monotonic() > deadline:
            break
        rows = knobs == "token-major V"
        us = timed_on(p, kc8, vc8_rows if rows else vc8, kq, decode_launch,
                      **({} if rows else knobs))
        name = knobs if rows else ",".join(f"{k}={v}" for k, v in knobs.items()) or "default"
        out.append(dict(kind=kind, B=p.B, L=p.L, knobs=name, us=us, GBps=nbytes / us / 1e3,
                        bf16_us=bf16_us))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--sweep", action="store_true", help="tune knobs at the target points")
    ap.add_argument("--quick", action="store_true", help="targets only")
    ap.add_argument("--fp8-sweep", action="store_true",
                    help="8-bit caches (--kv-dtypes): knobs at the targets (default: off)")
    ap.add_argument("--kv-dtypes", default=",".join(KV8),
                    help=f"8-bit caches to time, of {', '.join(KV8)} (default: all)")
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="stop measuring after this many seconds, then report (0: no limit)")
    ap.add_argument("--dry-run", action="store_true", help="CPU smoke test (see doc)")
    args = ap.parse_args()
    kinds = [k for k in args.kv_dtypes.split(",") if k]
    if bad := [k for k in kinds if k not in KV8]:
        ap.error(f"--kv-dtypes: {', '.join(bad)} not one of {', '.join(KV8)}")
    if not DRY and not torch.cuda.is_available():
        print("bench/attention.py needs CUDA (or --dry-run)", file=sys.stderr)
        return 2
    deadline = time.monotonic() + args.budget_s if args.budget_s else float("inf")
    name = "cpu (dry run)" if DRY else torch.cuda.get_device_properties(0).name
    l2 = 1 << 20 if DRY else getattr(torch.cuda.get_device_properties(0), "L2_cache_size",
                                      50 << 20)
    copy_bw = copy_bandwidth()
    print(f"device {name}, {num_sms()} SMs, L2 {l2 >> 20} MiB; "
          f"torch {torch.__version__}, triton {triton.__version__}")
    print(f"copy bandwidth (read+write): {copy_bw:.0f} GB/s", flush=True)
    result = {"device": name, "copy_GBps": copy_bw, "torch": torch.__version__,
              "triton": triton.__version__, "block_size": BS, "head_dim": D,
              "dtype": str(DT), "targets": [], "grid": [], "sweep": []}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"attention-{time.strftime('%Y%m%d-%H%M%S')}.json")

    def save():
        with open(path, "w") as fh:
            json.dump(result, fh, indent=1)

    def timed(hq, hkv, B, L):
        if time.monotonic() > deadline:
            return {"hq": hq, "hkv": hkv, "B": B, "L": L, "skipped": "time budget"}
        r = measure(hq, hkv, B, L, l2)
        print(fmt(r, copy_bw), flush=True)
        return r

    for hq, hkv in GQAS:
        for B, L in TARGETS:
            r = timed(hq, hkv, B, L)
            r["pass"] = r.get("ratio", 0) >= 0.90
            result["targets"].append(r)
    save()
    for hq, hkv in GQAS if not args.quick else ():
        for B, L in itertools.product(GRID_B, GRID_L):
            result["grid"].append(timed(hq, hkv, B, L))
        save()
    sdpa_us = {(r["B"], r["L"]): r.get("sdpa_us") for r in result["targets"] if r["hq"] == 16}
    for B, L in TARGETS if args.sweep else ():  # paged only, 16/8; ratio vs the target's SDPA
        p = make_point(16, 8, B, L, l2)
        for (bn, nw, ns), sp in itertools.product(
                ((64, 4, 4), (128, 8, 3), (64, 4, 2), (64, 4, 1), (32, 4, 3), (64, 8, 3)),
                (1, 2, 3, 4, 8, 16)):
            if time.monotonic() > deadline:
                break
            r = run_point(p, 16, 8, B, L, sdpa=False, rep=40, block_n=bn, num_warps=nw,
                          num_stages=ns, num_splits=sp)
            if sdpa_us.get((B, L)):
                r["ratio"] = sdpa_us[(B, L)] / r["paged_us"]
            result["sweep"].append(r)
        del p
        save()
    for B, L in TARGETS8:  # 8-bit caches as the engine runs them
        p = make_point(16, 8, B, L, l2)
        bf16_us = timed_on(p, p.kc, p.vc, {}, rep=100)
        for kind in kinds if time.monotonic() < deadline else ():
            result.setdefault("kv8", []).append(measure8(p, kind, copy_bw, bf16_us))
        del p
        save()
    for B, L in TARGETS if args.fp8_sweep else ():
        p = make_point(16, 8, B, L, l2)
        for kind in kinds:
            result.setdefault("fp8_sweep", []).extend(fp8_sweep(p, kind, deadline))
        del p
        save()
    print(f"\nwrote {path}\npaged decode attention, {DT}, block {BS}, head_dim {D}; "
          f"copy {copy_bw:.0f} GB/s; ratio = SDPA time / paged time = paged GB/s / SDPA GB/s")
    for B, L in TARGETS if args.sweep else ():
        rows = sorted((r for r in result["sweep"] if (r["B"], r["L"]) == (B, L)),
                      key=lambda r: r["paged_us"])
        print(f"sweep B={B} L={L} (16/8), fastest of {len(rows)} (auto config: see targets):")
        for r in rows[:5]:
            print(f"  bn={r['block_n']:<3} w={r['num_warps']} st={r['num_stages']} "
                  f"{fmt(r, copy_bw)} ratio {r.get('ratio', 0):.2f}")
    print(HEADER)
    for r in result["grid"]:
        print(fmt(r, copy_bw))
    for (B, L), kind in itertools.product(TARGETS if args.fp8_sweep else (), kinds):
        rows = sorted((r for r in result["fp8_sweep"] if (r["B"], r["L"], r["kind"]) ==
                       (B, L, kind)), key=lambda r: r["us"])
        if not rows:
            continue
        print(f"{kind} cache B={B} L={L} (16/8): bf16 default {rows[0]['bf16_us']:.1f} us; "
              f"fastest of {len(rows)}:")
        for r in rows[:4] + [r for r in rows if r["knobs"] in ("default", "token-major V")]:
            print(f"  {r['knobs']:<28} {r['us']:8.1f} us {r['GBps']:7.0f} GB/s (its bytes) "
                  f"x{r['bf16_us'] / r['us']:.2f} vs bf16")
    print("8-bit caches as the engine runs them, 16/8 heads (>= 0.85 of copy):")
    for r in result.get("kv8", []):
        print(f"  {r['kind']:<9} {r['B']:>4} x {r['L']:<6} {r['us']:8.1f} us {r['GBps']:7.0f} "
              f"GB/s {r['of_copy']:5.2f} of copy  x{r['x_bf16']:.2f} vs bf16 "
              f"({r['bf16_us']:.1f} us)  relerr {r['relerr_vs_bf16_cache']:.1e}  "
              f"{'PASS' if r['of_copy'] >= 0.85 else 'FAIL'}")
    print("targets (ratio >= 0.90):")
    for r in result["targets"]:
        print(fmt(r, copy_bw), "PASS" if r["pass"] else "FAIL")
    return 0


if __name__ == "__main__":
    sys.exit(main())
