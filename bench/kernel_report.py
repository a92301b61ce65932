"""What ptxas makes of the paged-attention kernels for sm_90 (H100/H200), compiled on any
machine, no GPU: registers, stack (spills), shared memory, SASS instructions and their mix
(MMAs, conversions, loads) per kernel variant (docs/benchmarks.md, "What the compiler
makes of the 8-bit decode kernels"). Uses the installed Triton (the GPU machine runs 3.6)
and the ptxas and cuobjdump bundled with it.

  python bench/kernel_report.py [--cases decode,prefill,store] [--sass DIR] [--json FILE]

Arguments are specialised as a launch specialises them for the engine's layout with
Qwen3-0.6B's heads (16 query / 8 KV heads, head_dim 128, block 16): strides of 1 are
constants, the others multiples of 16 (the int8 scale caches' slot stride, Hkv = 8, is
neither). "instr/KiB" (decode) estimates the warp instructions a program issues per KiB of
K and V it reads: the whole SASS taken as the tile loop (held twice with a transposed V:
whole tiles and the masked last one) times the warps, over a tile's bytes.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

if not __package__:  # run as a script: the checkout's root, not bench/, leads sys.path
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# compiled for sm_90, never interpreted: a caller's TRITON_INTERPRET=1 (the test suite sets it
# for its CPU checks) would make the kernels below InterpretedFunctions, which cannot compile
os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import pagedq.kernels.decode_attention as dec  # noqa: E402
import pagedq.kernels.prefill_attention as pre  # noqa: E402
import pagedq.kernels.rope_store as rs  # noqa: E402
import pagedq.kernels.store_kvcache as st  # noqa: E402

TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
HKV, D, BS = 8, 128, 16
CONVERSIONS = ("F2FP", "F2F", "I2F", "PRMT", "HADD2")  # 8-bit -> 16-bit, packing, permutes


def compile_sm90(fn, ptrs: dict, floats: set, const: dict, warps: int, stages: int,
                 aligned=(), fusion: bool = True):
    names = fn.arg_names
    sig = {n: "constexpr" if n in const else "*" + ptrs[n] if n in ptrs else
           "fp32" if n in floats else "i32" for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn, sig, constexprs=dict(const), attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, num_stages=stages,
                                       enable_fp_fusion=fusion))


def decode(kv: str, warps: int, stages: int, swap=False, mma8=False, q="bf16", bn=64):
    """_decode_kernel on a cache of Triton dtype ``kv`` in the engine's layout (an 8-bit V
    transposed); fp8 e4m3 with per-head scales, int8 with its scale caches."""
    eight = kv != "bf16"
    ptrs = dict(q_ptr=q, k_ptr=kv, v_ptr=kv, bt_ptr="i32", lens_ptr="i32", order_ptr="i32",
                out_ptr=q, part_ptr="fp32", lse_ptr="fp32", ks_ptr="fp32", vs_ptr="fp32",
                ksc_ptr="fp32", vsc_ptr="fp32")
    const = dict(HQ=16, G=2, G_PAD=16, D=D, BS=BS, BLOCK_N=bn, SINGLE=False, F32_DOT=False,
                 FP8_KV=kv.startswith("fp8"), V_T=eight, ORDERED=True, SWAP=swap, MMA8=mma8,
                 HEAD_SCALE=kv == "fp8e4nv", TOKEN_SCALE=kv == "i8", s_kd=1,
                 **({"s_vt": 1} if eight else {"s_vd": 1}))
    aligned = ["q_ptr", "k_ptr", "v_ptr", "out_ptr", "part_ptr", "lse_ptr", "ksc_ptr",
               "vsc_ptr", "s_qb", "s_qh", "s_kb", "s_kt", "s_kh", "s_vb", "s_vh", "s_ob",
               "s_oh", "s_scb", "s_vd" if eight else "s_vt"]
    tile_kib = 2 * bn * D * (2 if kv == "bf16" else 1) / 1024  # K and V of one tile
    # the SASS holds the tile loop twice with V transposed (whole tiles, the masked last)
    return compile_sm90(dec._decode_kernel, ptrs, {"qk_scale", "v_scale"}, const, warps,
                        stages, aligned), tile_kib * (2 if eight else 1)


def prefill(kv: str):
    eight = kv != "bf16"
    ptrs = dict(q_ptr="bf16", k_ptr=kv, v_ptr=kv, bt_ptr="i32", lens_ptr="i32", cu_ptr="i32",
                out_ptr="bf16", ks_ptr="fp32", vs_ptr="fp32", ksc_ptr="fp32", vsc_ptr="fp32")
    const = dict(G=2, D=D, BS=BS, BLOCK_M=64, BLOCK_Q=32, BLOCK_N=64, F32_DOT=False, V_T=eight,
                 HEAD_SCALE=kv == "fp8e4nv", TOKEN_SCALE=kv == "i8", s_kd=1,
                 **({"s_vt": 1} if eight else {"s_vd": 1}))
    aligned = ["q_ptr", "k_ptr", "v_ptr", "out_ptr", "ksc_ptr", "vsc_ptr", "s_qt", "s_qh",
               "s_kb", "s_kt", "s_kh", "s_vb", "s_vh", "s_ot", "s_oh", "s_scb",
               "s_vd" if eight else "s_vt"]
    return compile_sm90(pre._prefill_kernel, ptrs, {"qk_scale", "v_scale"}, const, 4,
                        2 if D > 128 else 3, aligned), None


def store(kv: str):
    if kv == "i8":
        ptrs = dict(k_ptr="bf16", v_ptr="bf16", kc_ptr="i8", vc_ptr="i8", slot_ptr="i64",
                    ksc_ptr="fp32", vsc_ptr="fp32")
        const = dict(H=HKV, H_PAD=HKV, D=D, D_PAD=D, BS=BS, s_kcd=1, s_vco=1)
        return compile_sm90(st._store_int8_kernel, ptrs, set(), const, 4, 1,
                            ["k_ptr", "v_ptr", "kc_ptr", "vc_ptr", "s_kt", "s_vt"], False), None
    ptrs = dict(k_ptr="bf16", v_ptr="bf16", kc_ptr=kv, vc_ptr=kv, slot_ptr="i64",
                ks_ptr="fp32", vs_ptr="fp32")
    const = dict(ROW=HKV * D, D=D, BS=BS, BLOCK=HKV * D, HEAD_SCALE=kv == "fp8e4nv",
                 TOP=448.0 if kv == "fp8e4nv" else 57344.0, s_kcd=1, s_vco=1)
    return compile_sm90(st._store_kernel, ptrs, set(), const, 4, 1,
                        ["k_ptr", "v_ptr", "kc_ptr", "vc_ptr", "s_kt", "s_vt"]), None


def rope_store(kv: str):
    ptrs = dict(q_ptr="bf16", k_ptr="bf16", v_ptr="bf16", pos_ptr="i64", cs_ptr="fp32",
                kc_ptr=kv, vc_ptr=kv, slot_ptr="i64", qw_ptr="bf16", kw_ptr="bf16",
                ks_ptr="fp32", vs_ptr="fp32", ksc_ptr="fp32", vsc_ptr="fp32")
    const = dict(HQ=16, HQ_PAD=16, HK=HKV, HK_PAD=HKV, D=D, HALF=D // 2, BS=BS, NORM=True,
                 HEAD_SCALE=kv == "fp8e4nv", TOP=0.0 if kv == "i8" else 448.0,
                 INT8=kv == "i8", s_kcd=1, s_vco=1)
    return compile_sm90(rs._rope_store_kernel, ptrs, {"eps"}, const, 4, 1,
                        ["q_ptr", "k_ptr", "v_ptr"], kv != "i8"), None


CASES = {
    "decode": {
        "bf16 tile (default: 4 warps, 5 stages, V token-major)": lambda: decode("bf16", 4, 5),
        "e4m3 tile (default: 1 warp, 2 stages)": lambda: decode("fp8e4nv", 1, 2),
        "e5m2 tile (default)": lambda: decode("fp8e5", 1, 2),
        "int8 tile (default), bf16 q": lambda: decode("i8", 1, 2),
        "int8 tile, fp16 q (an fp16 model)": lambda: decode("i8", 1, 2, q="fp16"),
        "e4m3 tile, 2 warps": lambda: decode("fp8e4nv", 2, 2),
        "e4m3 tile, 1 warp, 3 stages": lambda: decode("fp8e4nv", 1, 3),
        "e4m3 tile, BLOCK_N 32": lambda: decode("fp8e4nv", 1, 2, bn=32),
        "e4m3 tile, BLOCK_N 128, 4 warps": lambda: decode("fp8e4nv", 4, 2, bn=128),
        "e4m3 swap (fp16 conversions, 4 warps; refused on the GPU)":
            lambda: decode("fp8e4nv", 4, 3, swap=True),
        "e4m3 swap8 (e4m3 wgmma, 4 warps, 3 stages)":
            lambda: decode("fp8e4nv", 4, 3, swap=True, mma8=True),
    },
    "prefill": {f"prefill {n}": (lambda kv=kv: prefill(kv)) for n, kv in (
        ("bf16", "bf16"), ("e4m3", "fp8e4nv"), ("e5m2", "fp8e5"), ("int8", "i8"))},
    "store": {**{f"store_kvcache {n}": (lambda kv=kv: store(kv)) for n, kv in (
        ("e4m3", "fp8e4nv"), ("e5m2", "fp8e5"), ("int8", "i8"))},
              **{f"qk_norm_rope_store {n}": (lambda kv=kv: rope_store(kv)) for n, kv in (
                  ("e4m3", "fp8e4nv"), ("int8", "i8"))}},
}


def report(kernel, kib) -> tuple[dict, str]:
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        res = subprocess.run([os.path.join(TOOLS, "cuobjdump"), "-res-usage", cubin],
                             capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([os.path.join(TOOLS, "cuobjdump"), "-sass", cubin],
                              capture_output=True, text=True, check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", res)
    ops: collections.Counter = collections.Counter()
    for line in sass.splitlines():
        op = re.match(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_.]+)?)",
                      line)
        if op:
            ops[op[1]] += 1
    total = sum(ops.values())
    warps = kernel.metadata.num_warps
    row = dict(registers=int(m[1]), stack=int(m[2]), shared=kernel.metadata.shared, warps=warps,
               sass=total, mma=sum(c for o, c in ops.items() if "MMA" in o or "GMMA" in o),
               conversions=sum(c for o, c in ops.items() if o.startswith(CONVERSIONS)),
               top=ops.most_common(12))
    if kib:  # (module doc) every warp runs the loop
        row["warp_instr_per_kib"] = total * warps / kib
    return row, sass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="decode,prefill,store",
                    help=f"groups of kernels, of {', '.join(CASES)} (default: all)")
    ap.add_argument("--sass", default=None, help="folder for each kernel's SASS (default: none)")
    ap.add_argument("--json", default=None, help="file for the rows (default: none)")
    args = ap.parse_args()
    groups = [g for g in args.cases.split(",") if g]
    if bad := [g for g in groups if g not in CASES]:
        ap.error(f"--cases: {', '.join(bad)} not one of {', '.join(CASES)}")
    print(f"triton {triton.__version__}, sm_90; {'kernel':58s} regs stack shared warps "
          f"SASS MMA conv  instr/KiB")
    rows = {}
    for name, make in ((n, f) for g in groups for n, f in CASES[g].items()):
        kernel, kib = make()
        row, sass = report(kernel, kib)
        rows[name] = row
        per = f"{row['warp_instr_per_kib']:9.0f}" if kib else ""
        print(f"  {name:58s} {row['registers']:4d} {row['stack']:5d} {row['shared']:6d} "
              f"{row['warps']:5d} {row['sass']:4d} {row['mma']:3d} {row['conversions']:4d} {per}")
        if args.sass:
            os.makedirs(args.sass, exist_ok=True)
            with open(os.path.join(args.sass, re.sub(r"\W+", "_", name) + ".sass"), "w") as f:
                f.write(sass)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
