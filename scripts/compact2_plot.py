#!/usr/bin/env python3
"""compact2 against compact on real traces (issue 29): the table per density
band and the plot, from the JSON lines of `examples/trace_sizes` (one file per
trace, named after it).

    for t in /work/traces/{tune,heldout}/*; do
      target/release/examples/trace_sizes $t > docs/bench/compact2/$(basename $t).jsonl
    done
    python3 scripts/compact2_plot.py docs/bench/compact2 docs/bench/compact2_vs_density.png

Steps written right after an anchor (no context) are left out: they are
`compact2` without context, which every subscriber reads.
"""

import glob
import json
import os
import statistics
import sys

BANDS = [(0, 0.5), (0.5, 1), (1, 2), (2, 5), (5, 25), (25, 100)]
HELDOUT = ("gpt2-2e-5", "gpt2-8e-5", "gpt2-warm-5e-6", "minilm-3e-6", "minilm-1.5e-5")


def main() -> None:
    src, png = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None
    rows = []
    for f in sorted(glob.glob(os.path.join(src, "*.jsonl"))):
        name = os.path.basename(f)[: -len(".jsonl")]
        for line in open(f):
            r = json.loads(line)
            r["trace"] = name
            if r["with_context"]:
                rows.append(r)
    print("| density | steps | traces | objects: median (min) ratio | payloads: median (min) ratio | compact B/changed | compact2 B/changed |")
    print("|---|---|---|---|---|---|---|")
    for lo, hi in BANDS:
        b = [r for r in rows if lo <= 100 * r["density"] < hi]
        if not b:
            continue
        changed = sum(r["changed"] for r in b)
        traces = ", ".join(sorted({r["trace"] + ("*" if r["trace"] in HELDOUT else "") for r in b}))
        print(
            f"| {lo:g}–{hi:g}% | {len(b)} | {traces} "
            f"| {statistics.median(r['ratio'] for r in b):.3f} ({min(r['ratio'] for r in b):.3f}) "
            f"| {statistics.median(r['payload_ratio'] for r in b):.3f} ({min(r['payload_ratio'] for r in b):.3f}) "
            f"| {sum(r['compact'] for r in b) / changed:.3f} | {sum(r['compact2'] for r in b) / changed:.3f} |"
        )
    if not png:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name in sorted({r["trace"] for r in rows}):
        rs = [r for r in rows if r["trace"] == name]
        held = name in HELDOUT
        ax.scatter(
            [100 * r["density"] for r in rs],
            [r["payload_ratio"] for r in rs],
            s=9,
            marker="^" if held else "o",
            label=name + (" (held out)" if held else " (tuning)"),
        )
    ax.axhline(1.15, color="grey", lw=0.8, ls="--")
    ax.axvspan(0.5, 5, color="grey", alpha=0.08)
    ax.set_xscale("log")
    ax.set_xlabel("density (% of elements changed by the step)")
    ax.set_ylabel("compact payload / compact2 payload")
    ax.set_title("compact2 against compact on real AdamW traces (bf16 casts)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    main()
