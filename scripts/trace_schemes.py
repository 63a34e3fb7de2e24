#!/usr/bin/env python3
"""Exact bit costs of candidate delta codings on a real trace, against today's
compact (Rice gaps + Exp-Golomb steps per block, parameters chosen exactly).

Each candidate partitions a block's positions into context classes from the
last one or two deltas since the anchor (the element's step then: age and
magnitude), Rice-codes each class's changed positions as gaps in the class's
own member order (the rest: in the full index order), and codes values as a
sign bit (relative to the last change's sign where known) plus magnitudes
through an escape list (the ranks of entries with |step| >= 2, Rice-coded,
then Exp-Golomb of |step| - 2). Prologue costs are counted as described in
`prologue_bits`.

    python scripts/trace_schemes.py TRACE [--anchor-every 10] [--steps 60] [--skip 0]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from trace_entropy import h2, key, steps  # noqa: E402

BLOCK = 1 << 22


def rice_bits(g: np.ndarray) -> tuple[int, int]:
    """(bits, k) of the best Rice code of gaps g (exact)."""
    if g.size == 0:
        return 0, 0
    best = None
    for k in range(0, 24):
        b = int((g >> k).sum()) + g.size * (k + 1)
        if best is None or b < best[0]:
            best = (b, k)
    return best


def eg_bits(m: np.ndarray) -> tuple[int, int]:
    """(bits, k) of the best Exp-Golomb code of m - 1 (m >= 1), no sign."""
    if m.size == 0:
        return 0, 0
    best = None
    for k in range(0, 12):
        y = (m - 1) + (1 << k)
        nb = np.floor(np.log2(y)).astype(np.int64) + 1
        b = int((2 * nb - k).sum()) - m.size  # eg_bits includes the sign: drop it
        if best is None or b < best[0]:
            best = (b, k)
    return best


def gamma(n: int) -> int:
    return 2 * int(np.floor(np.log2(n + 1))) + 1


def class_cost(gaps: np.ndarray, mags: np.ndarray, relsign_opp: np.ndarray | None, split_sign: bool) -> int:
    """Bits of one class: gaps, signs, escape list of magnitudes >= 2, and
    its prologue (count, parameters)."""
    n = gaps.size
    if n == 0:
        return 1  # "empty" flag
    bits = gamma(n) + 5 + rice_bits(gaps)[0]
    # signs
    if split_sign and relsign_opp is not None:
        r = np.flatnonzero(relsign_opp)
        if r.size:
            bits += gamma(r.size) + 5 + rice_bits(np.diff(r, prepend=-1) - 1)[0]
        else:
            bits += 1
    else:
        bits += n
    # magnitudes
    big = np.flatnonzero(mags >= 2)
    if big.size:
        bits += gamma(big.size) + 5 + rice_bits(np.diff(big, prepend=-1) - 1)[0]
        bits += 4 + eg_bits(mags[big] - 1)[0]
    else:
        bits += 1
    return bits


def today_cost(gaps: np.ndarray, mags: np.ndarray) -> int:
    n = gaps.size
    if n == 0:
        return 0
    return rice_bits(gaps)[0] + eg_bits(mags)[0] + n  # + sign bits


SCHEMES = ["today", "floor", "esc", "prev", "prev+mag", "prev+mag+sgn", "prev2+mag", "prev2+mag+sgn", "ever2+mag+sgn"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--anchor-every", type=int, default=10)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--skip", type=int, default=0)
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args()
    A = args.anchor_every
    tot = {s: 0 for s in SCHEMES}
    n_tot = 0
    last = {}
    lstep = {}
    for t, state, ch in steps(Path(args.trace)):
        if t == 0:
            continue
        if t > args.steps:
            break
        since = (t - 1) % A
        if since == 0:
            for n, v in state.items():
                last[n] = np.full(v.size, -(1 << 30), np.int32)
                lstep[n] = np.zeros(v.size, np.int32)
        cost = {s: 0 for s in SCHEMES}
        changes = 0
        for n, v in state.items():
            if n not in ch:
                continue
            idx, new = ch[n]
            s = (key(new) - key(v[idx])) & 0xFFFF
            s = np.where(s >= 0x8000, s - 0x10000, s).astype(np.int64)
            changes += idx.size
            for b0 in range(0, v.size, BLOCK):
                b1 = min(b0 + BLOCK, v.size)
                sel = (idx >= b0) & (idx < b1)
                bi = idx[sel] - b0
                bs = s[sel]
                if bi.size == 0:
                    continue
                mags = np.abs(bs)
                age = t - last[n][b0:b1]
                lst = lstep[n][b0:b1]
                gaps = np.diff(bi, prepend=-1) - 1
                cost["today"] += today_cost(gaps, mags)
                cost["floor"] += float(h2(np.array([bi.size]), np.array([b1 - b0]))[0])
                _, c = np.unique(bs, return_counts=True)
                cost["floor"] += float(-(c * np.log2(c / c.sum())).sum())
                lm = np.minimum(np.abs(lst), 2)

                def classes(cls: np.ndarray, k_rest: int, split_sign: bool, signed_classes: set[int]) -> int:
                    """cls: class per element of the block; class 0 = rest (full-space gaps)."""
                    bits = 0
                    ccls = cls[bi]
                    for c in range(int(cls.max()) + 1):
                        m = ccls == c
                        if c == 0:
                            pos = bi[m]
                            g = np.diff(pos, prepend=-1) - 1
                        else:
                            members = np.flatnonzero(cls == c)
                            ranks = np.searchsorted(members, bi[m])
                            g = np.diff(ranks, prepend=-1) - 1
                        opp = None
                        if c in signed_classes:
                            opp = (np.sign(bs[m]) != np.sign(lst[bi[m]])).astype(np.int8)
                        bits += class_cost(g, mags[m], opp, split_sign)
                    return bits

                cost["esc"] += classes(np.zeros(b1 - b0, np.int64), 0, False, set())
                in1 = age == 1
                in2 = age == 2
                cost["prev"] += classes(in1.astype(np.int64), 0, False, set())
                cm = np.where(in1, lm, 0).astype(np.int64)
                cost["prev+mag"] += classes(cm, 0, False, set())
                cost["prev+mag+sgn"] += classes(cm, 0, True, {1, 2})
                c2 = np.where(in1, lm, np.where(in2, 2 + lm, 0)).astype(np.int64)
                cost["prev2+mag"] += classes(c2, 0, False, set())
                cost["prev2+mag+sgn"] += classes(c2, 0, True, {1, 2, 3, 4})
                ever = (age > 2) & (age < (1 << 29))
                ce = np.where(in1, lm, np.where(in2, 2 + lm, np.where(ever, 5, 0))).astype(np.int64)
                cost["ever2+mag+sgn"] += classes(ce, 0, True, {1, 2, 3, 4, 5})
            last[n][idx] = t
            lstep[n][idx] = s
        if since > 0 and t > args.skip and changes:
            n_tot += changes
            for k in SCHEMES:
                tot[k] += cost[k]
            if not args.quiet:
                print(
                    f"t={t} since={since} d={changes / sum(v.size for v in state.values()):.4f} "
                    + " ".join(f"{k} {cost[k] / changes / 8:.3f}" for k in SCHEMES),
                    flush=True,
                )
    print(f"{args.trace} (anchor every {A}, {n_tot} changes in deltas with context), bytes/change:")
    print("  " + "  ".join(f"{k} {tot[k] / n_tot / 8:.4f}" for k in SCHEMES))
    print("  ratio today/x: " + "  ".join(f"{k} {tot['today'] / max(tot[k], 1):.3f}" for k in SCHEMES))


if __name__ == "__main__":
    sys.exit(main())
