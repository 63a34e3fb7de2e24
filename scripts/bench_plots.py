#!/usr/bin/env python3
"""Runs `weightcast bench codec` over a learning-rate sweep and draws the plots
of docs/benchmarks.md.

    cargo build --release
    python3 scripts/bench_plots.py [--elements 100000000] [--out docs/bench]

Needs matplotlib (pip install matplotlib). Writes one JSON per run and the PNGs
into --out, and prints a markdown table.
"""
import argparse
import json
import os
import subprocess
import sys

LRS = [1e-6, 2e-6, 3e-6, 5e-6, 1e-5]


def run(binary, elements, lr, threads, out, reps, steps):
    path = os.path.join(out, f"codec-lr{lr:g}-t{threads}.json")
    cmd = [binary, "bench", "codec", "--elements", str(elements), "--lr", str(lr),
           "--steps", str(steps), "--reps", str(reps), "--threads", str(threads),
           "--json", path]
    print("+", " ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, check=True)
    with open(path) as f:
        return json.load(f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--elements", type=int, default=100_000_000)
    ap.add_argument("--out", default="docs/bench")
    ap.add_argument("--binary", default="target/release/weightcast")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--threads", default="1,2")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    threads = [int(t) for t in args.threads.split(",")]

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reports = {(lr, t): run(args.binary, args.elements, lr, t, args.out, args.reps, args.steps)
               for t in threads for lr in LRS}

    def last_rows(rep):
        step = max(r["step"] for r in rep["rows"])
        return {r["encoding"]: r for r in rep["rows"] if r["step"] == step}, rep["stats"][-1]

    # Size: bytes per changed element against density.
    t0 = threads[0]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    dens, comp, trl, floor = [], [], [], []
    for lr in LRS:
        rows, st = last_rows(reports[(lr, t0)])
        dens.append(st["density"] * 100)
        comp.append(rows["compact"]["bytes_per_changed"])
        trl.append(rows["trl"]["bytes_per_changed"])
        floor.append(st["position_entropy"] + st["value_entropy"])
    ax.plot(dens, trl, "s-", label="weightcast trl (TRL layout)")
    ax.plot(dens, comp, "o-", label="weightcast compact")
    ax.plot(dens, floor, "k--", label="entropy floor (iid positions + values)")
    ax.axhspan(2.07, 2.88, color="tab:gray", alpha=0.2, label="PULSE/grail published (2.07–2.88)")
    ax.axhline(2.9, color="tab:red", lw=0.8, ls=":", label="slime deltas_zstd (~2.9)")
    ax.set_xlabel("density (% of elements changed)")
    ax.set_ylabel("bytes per changed element")
    ax.set_ylim(0, 6.5)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center right")
    ax.set_title(f"Delta size, synthetic RL steps ({args.elements:.0e} bf16 elements)")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "bytes_per_changed.png"), dpi=110)

    # Speed: ratios to the plain compare.
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for t in threads:
        for enc, marker in (("compact", "o"), ("trl", "s")):
            xs, enc_r, app_r = [], [], []
            for lr in LRS:
                rows, st = last_rows(reports[(lr, t)])
                xs.append(st["density"] * 100)
                enc_r.append(rows[enc]["encode_vs_compare"])
                app_r.append(rows[enc]["apply_vs_compare"])
            ax.plot(xs, enc_r, marker + "-", label=f"{enc} encode, {t} thread(s)")
            ax.plot(xs, app_r, marker + ":", label=f"{enc} decode+apply, {t} thread(s)")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(0.7, color="tab:red", lw=0.8, ls="--", label="encode target 0.7x")
    ax.set_xlabel("density (% of elements changed)")
    ax.set_ylabel("throughput / plain two-buffer compare")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    ax.set_title("Codec speed relative to a plain compare of the same buffers")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "speed_vs_compare.png"), dpi=110)

    print("| threads | lr | density | encoding | B/changed | floor | reduction | encode/compare | apply/compare | encode extra peak | apply extra peak |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for t in threads:
        for lr in LRS:
            rows, st = last_rows(reports[(lr, t)])
            for enc in ("compact", "trl"):
                r = rows[enc]
                print(f"| {t} | {lr:g} | {st['density']*100:.2f}% | {enc} | {r['bytes_per_changed']:.3f} | "
                      f"{st['position_entropy'] + st['value_entropy']:.3f} | {r['reduction']:.0f}x | "
                      f"{r['encode_vs_compare']:.2f}x | {r['apply_vs_compare']:.2f}x | "
                      f"{r['encode_extra_peak'] / 2**20:.0f} MiB | {r['apply_extra_peak'] / 2**20:.0f} MiB |")


if __name__ == "__main__":
    main()
