"""PNG plots of an open-loop JSON of bench/service.py --rate, written next to it:
STEM-throughput.png (achieved vs offered output tok/s against the arrival rate),
STEM-ttft-cdf.png and STEM-itl-cdf.png (one curve per rate). Needs matplotlib (the dev
extra); the GPU machine writes the JSON and this runs where matplotlib is.

  python bench/plot.py bench/results/service-openloop-qwen3-0.6b.json
"""
from __future__ import annotations

import json
import os
import sys


def make(path: str) -> list[str]:
    """Writes the three PNGs of the JSON at path; returns their paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path) as f:
        res = json.load(f)
    if res.get("mode") != "open-loop":
        raise SystemExit(f"{path}: not an open-loop result of bench/service.py --rate")
    rates = res["rates"]
    sat = (res.get("saturation") or {}).get("jobs_s")
    title = f"{res['shape']} on {res['device']}" + (" (smoke)" if res.get("smoke") else "")
    stem = os.path.splitext(path)[0]
    out = []

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    x = [r["rate"] for r in rates]
    ax.plot(x, [r["offered_tok_s"] for r in rates], "--", color="grey", label="offered")
    ax.plot(x, [r["tok_s"] for r in rates], "o-", label="achieved (steady state)")
    if sat:
        ax.axvline(sat, color="red", lw=0.8, label=f"saturation {sat:.2f} jobs/s")
    ax.set(xlabel="arrival rate (jobs/s)", ylabel="output tokens/s", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    out.append(_save(fig, plt, stem + "-throughput.png"))

    for key, unit, scale in (("ttft", "s", 1.0), ("itl", "ms", 1e3)):
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
        for r in rates:
            frac = f" ({r['rate'] / sat:.0%})" if sat else ""
            # a log axis holds no zeros (ITL of tokens read in one event)
            pts = [(v * scale, q) for v, q in zip(r[f"{key}_cdf"], res["cdf_q"], strict=True)
                   if v is not None and v > 0]
            ax.plot([v for v, _ in pts], [q for _, q in pts],
                    label=f"{r['rate']:.2f} jobs/s{frac}")
        ax.set_xscale("log")
        ax.set(xlabel=f"{key.upper()} ({unit}, log scale)", ylabel="fraction of samples",
               title=f"{key.upper()} CDF per arrival rate, {title}")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize="small")
        out.append(_save(fig, plt, f"{stem}-{key}-cdf.png"))
    return out


def _save(fig, plt, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> int:
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        print("usage: python bench/plot.py JSON  (an open-loop result of bench/service.py)",
              file=sys.stderr)
        return 2
    try:
        paths = make(sys.argv[1])
    except ImportError:
        print("bench/plot.py needs matplotlib: pip install matplotlib (the dev extra)",
              file=sys.stderr)
        return 2
    for p in paths:
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
