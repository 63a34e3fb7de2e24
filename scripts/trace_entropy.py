#!/usr/bin/env python3
"""Empirical entropy floors of a real trace (made by scripts/make_traces.py),
without and with per-element history as context.

For each step t and each parameter, positions are split into context classes
and each class is charged n·H(k/n) bits (n elements in the class, k of them
changed): the floor of any coder that knows the classes and each class's
density in that tensor at that step. Values are charged the empirical entropy
of their ulp step within the tensor, given the context (the class and the sign
of the element's last change). Reported per step as bytes per changed element.

Contexts (an element's history since the trace's first step, or since the
last anchor with --anchor-every):

    none     one class
    prev     changed at t-1 / not
    prev2    changed at t-1 / at t-2 (not t-1) / not
    ever     changed at t-1 / earlier / never
    ever2    changed at t-1 / at t-2 / earlier / never

    python scripts/trace_entropy.py /work/traces/tune/minilm-1e-5 [--steps 50] [--anchor-every 0]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np


def h2(k: np.ndarray, n: np.ndarray) -> np.ndarray:
    """n·H(k/n) in bits, elementwise; 0 where k is 0 or n."""
    k = k.astype(np.float64)
    n = n.astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(n > 0, k / np.maximum(n, 1), 0)
        t = -(k * np.log2(np.where(p > 0, p, 1)) + (n - k) * np.log2(np.where(p < 1, 1 - p, 1)))
    return np.nan_to_num(t)


def entropy_of(symbols: np.ndarray) -> float:
    """Total bits of the empirical order-0 entropy of `symbols`."""
    if symbols.size == 0:
        return 0.0
    _, c = np.unique(symbols, return_counts=True)
    p = c / c.sum()
    return float(-(c * np.log2(p)).sum())


def key(w: np.ndarray) -> np.ndarray:
    """bf16 ordered key (docs/format.md §2)."""
    w = w.astype(np.int64)
    return np.where(w & 0x8000, (~w) & 0xFFFF, w | 0x8000)


def steps(trace: Path):
    import zstandard
    from safetensors.numpy import load, load_file

    state = {n: v.reshape(-1).copy() for n, v in load_file(str(trace / "step_00000.safetensors")).items()}
    yield 0, state, {}
    dz = zstandard.ZstdDecompressor()
    t = 1
    while (trace / f"step_{t:05}.delta.zst").exists():
        try:
            blob = dz.decompress((trace / f"step_{t:05}.delta.zst").read_bytes(), max_output_size=1 << 31)
        except zstandard.ZstdError:
            return  # being written
        ch = {}
        if blob:
            d = load(blob)
            for k in d:
                if k.endswith(".gap"):
                    n = k[:-4]
                    idx = np.cumsum(d[k].astype(np.int64) + 1) - 1
                    ch[n] = (idx, d[n + ".val"])
        yield t, state, ch
        for n, (idx, val) in ch.items():
            state[n][idx] = val
        t += 1


CONTEXTS = ["none", "prev", "prev2", "ever", "ever2"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--anchor-every", type=int, default=0)
    ap.add_argument("--every", type=int, default=1, help="report every N-th step")
    args = ap.parse_args()
    last = {}  # name -> int32 last changed step (-1 never)
    lsign = {}  # name -> int8 sign of last change
    tot = {c: [0.0, 0.0] for c in CONTEXTS}
    tot_n = 0
    print("step density | pos bits/change: " + " ".join(CONTEXTS) + " | val bits: none sign prevsign | B/change none ever2+sign")
    for t, state, ch in steps(Path(args.trace)):
        if t == 0:
            for n, v in state.items():
                last[n] = np.full(v.size, -(1 << 30), np.int32)
                lsign[n] = np.zeros(v.size, np.int8)
            continue
        if args.steps and t > args.steps:
            break
        if args.anchor_every and (t - 1) % args.anchor_every == 0:
            for n in last:
                last[n][:] = -(1 << 30)
                lsign[n][:] = 0
        pos = {c: 0.0 for c in CONTEXTS}
        val = {"none": 0.0, "class": 0.0, "sign": 0.0}
        changes = 0
        total = 0
        for n, v in state.items():
            total += v.size
            if n not in ch:
                continue
            idx, new = ch[n]
            k = idx.size
            changes += k
            N = v.size
            l = last[n]
            age = t - l  # 1 = changed at t-1
            cls_all = {
                "prev": (age == 1).astype(np.int8),
                "prev2": np.minimum(age, 3).astype(np.int8),
                "ever": np.where(age == 1, 0, np.where(age < (1 << 29), 1, 2)).astype(np.int8),
                "ever2": np.where(age <= 2, age, np.where(age < (1 << 29), 3, 4)).astype(np.int8),
            }
            pos["none"] += float(h2(np.array([k]), np.array([N]))[0])
            for c, cls in cls_all.items():
                nc = np.bincount(cls, minlength=5)
                kc = np.bincount(cls[idx], minlength=5)
                pos[c] += float(h2(kc, nc).sum())
            s = (key(new) - key(v[idx])) & 0xFFFF
            s = np.where(s >= 0x8000, s - 0x10000, s)
            val["none"] += entropy_of(s)
            cl = cls_all["ever2"][idx].astype(np.int64)
            val["class"] += entropy_of(s * 8 + cl)  - entropy_of(cl)
            ls = lsign[n][idx].astype(np.int64)
            val["sign"] += entropy_of(s * 16 + cl * 3 + (ls + 1)) - entropy_of(cl * 3 + ls + 1)
            l[idx] = t
            lsign[n][idx] = np.sign(s).astype(np.int8)
        if changes == 0:
            continue
        tot_n += changes
        for c in CONTEXTS:
            tot[c][0] += pos[c]
        for c, vv in zip(["none", "class", "sign"], [val["none"], val["class"], val["sign"]]):
            tot.setdefault("v" + c, [0.0])[0] += vv
        if t % args.every == 0:
            print(
                f"{t:4} {changes / total:7.3%} | "
                + " ".join(f"{pos[c] / changes:5.2f}" for c in CONTEXTS)
                + f" | {val['none'] / changes:4.2f} {val['class'] / changes:4.2f} {val['sign'] / changes:4.2f}"
                + f" | {(pos['none'] + val['none']) / changes / 8:5.3f} {(pos['ever2'] + val['sign']) / changes / 8:5.3f}"
                + f" {(pos['prev2'] + val['sign']) / changes / 8:5.3f}",
                flush=True,
            )
    print(
        "all  | "
        + " ".join(f"{tot[c][0] / tot_n:5.2f}" for c in CONTEXTS)
        + f" | {tot['vnone'][0] / tot_n:4.2f} {tot['vclass'][0] / tot_n:4.2f} {tot['vsign'][0] / tot_n:4.2f}"
    )


if __name__ == "__main__":
    sys.exit(main())
