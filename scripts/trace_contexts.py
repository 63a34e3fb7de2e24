#!/usr/bin/env python3
"""Which history to condition on: entropy floors of positions and values of a
real trace (scripts/make_traces.py) under candidate contexts, with anchors every
K steps (the context is empty after an anchor: the delta after it has none).

Position floors: per tensor and step, each context class c is charged
n_c·H(k_c/n_c). Value floors: empirical entropy of the ulp step given the
context. Printed as bits per changed element, averaged over the steps that have
context (the 2nd..K-th after an anchor), with the no-context floor beside.

    python scripts/trace_contexts.py TRACE [--anchor-every 10] [--steps 60]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from trace_entropy import entropy_of, h2, key, steps  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--anchor-every", type=int, default=10)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--skip", type=int, default=0, help="ignore the first N steps")
    args = ap.parse_args()
    A = args.anchor_every
    shapes = {}
    from safetensors import safe_open

    with safe_open(str(Path(args.trace) / "step_00000.safetensors"), "np") as f:
        for n in f.keys():
            shapes[n] = f.get_slice(n).get_shape()
    pos_tot: dict[str, float] = {}
    val_tot: dict[str, float] = {}
    n_tot = 0
    last = {}
    lsign = {}
    lmag = {}
    prev_row = {}
    prev_col = {}
    for t, state, ch in steps(Path(args.trace)):
        if t == 0:
            continue
        if t > args.steps:
            break
        since = (t - 1) % A  # deltas since the anchor before this one
        if since == 0:
            for n, v in state.items():
                last[n] = np.full(v.size, -(1 << 30), np.int32)
                lsign[n] = np.zeros(v.size, np.int8)
                lmag[n] = np.zeros(v.size, np.int8)
                sh = shapes[n]
                rows = sh[0] if len(sh) == 2 else 1
                cols = sh[1] if len(sh) == 2 else v.size
                prev_row[n] = np.zeros(rows, np.float64)
                prev_col[n] = np.zeros(cols, np.float64)
        record = since > 0 and t > args.skip
        pos: dict[str, float] = {}
        val: dict[str, float] = {}
        changes = 0

        def add(d, k, x):
            d[k] = d.get(k, 0.0) + x

        for n, v in state.items():
            N = v.size
            if n not in ch:
                idx = np.zeros(0, np.int64)
                new = np.zeros(0, np.uint16)
            else:
                idx, new = ch[n]
            k = idx.size
            changes += k
            sh = shapes[n]
            rows = sh[0] if len(sh) == 2 else 1
            cols = sh[1] if len(sh) == 2 else N
            age = t - last[n]
            c_prev = (age == 1).astype(np.int64)
            c_prev2 = np.minimum(age, 3).astype(np.int64)
            c_ever = np.where(age == 1, 0, np.where(age < (1 << 29), 1, 2)).astype(np.int64)
            c_ever2 = np.where(age <= 2, age, np.where(age < (1 << 29), 3, 4)).astype(np.int64)
            # magnitude of the last change (1 or more) for the previous delta's positions
            c_prevmag = np.where(age == 1, np.minimum(lmag[n], 2), 0).astype(np.int64)
            # row / column density of the previous delta, bucketed (log2)
            def bucket(x):
                return np.clip(np.floor(np.log2(np.maximum(x, 1e-9)) + 12), 0, 12).astype(np.int64)

            rb = bucket(prev_row[n])[np.arange(N) // cols] if rows > 1 else np.zeros(N, np.int64)
            cb = bucket(prev_col[n])[np.arange(N) % cols] if rows > 1 else np.zeros(N, np.int64)
            mag3 = np.minimum(lmag[n], 3).astype(np.int64)
            ctx = {
                "none": np.zeros(N, np.int64),
                "prev+mag3": np.where(age == 1, mag3, 0),
                "prev2+mag3": np.where(age <= 2, (age - 1) * 4 + mag3, 8),
                "ever2+mag3": np.where(age <= 2, (age - 1) * 4 + mag3, np.where(age < (1 << 29), 8 + mag3, 12)),
                "prev": c_prev,
                "prev+mag": c_prevmag,
                "prev2": c_prev2,
                "ever": c_ever,
                "ever2": c_ever2,
                "row": rb,
                "col": cb,
                "prev2+row": c_prev2 * 16 + rb,
                "prev2+col": c_prev2 * 16 + cb,
                "ever2+row": c_ever2 * 16 + rb,
                "ever2+row+col": (c_ever2 * 16 + rb) * 16 + cb,
            }
            for c, cl in ctx.items():
                m = int(cl.max()) + 1 if N else 1
                nc = np.bincount(cl, minlength=m)
                kc = np.bincount(cl[idx], minlength=m)
                add(pos, c, float(h2(kc, nc).sum()))
            # Markov within the step: was the element before changed now (as a
            # contrast: not a history context).
            chg = np.zeros(N, np.int8)
            chg[idx] = 1
            before = np.concatenate([[0], chg[:-1]]).astype(np.int64)
            cl = before * 8 + c_prev2
            nc = np.bincount(cl, minlength=32)
            kc = np.bincount(cl[idx], minlength=32)
            add(pos, "prev2+left", float(h2(kc, nc).sum()))
            if k:
                s = (key(new) - key(v[idx])) & 0xFFFF
                s = np.where(s >= 0x8000, s - 0x10000, s)
                ls = lsign[n][idx].astype(np.int64) + 1
                lm = np.minimum(lmag[n][idx], 3).astype(np.int64)
                ev = c_ever2[idx]
                pv = c_prev2[idx]
                add(val, "none", entropy_of(s))
                add(val, "prev2", entropy_of(s * 8 + pv) - entropy_of(pv))
                pm = np.where(pv == 1, lm, 0)
                add(val, "prev+sign+mag", entropy_of(s * 64 + (np.where(pv == 1, ls, 1) * 4 + pm)) - entropy_of(np.where(pv == 1, ls, 1) * 4 + pm))
                p2 = np.where(pv <= 2, pv * 12 + ls * 4 + lm, 0)
                add(val, "prev2+sign+mag", entropy_of(s * 64 + p2) - entropy_of(p2))
                add(val, "prev2+sign", entropy_of(s * 32 + pv * 3 + ls) - entropy_of(pv * 3 + ls))
                add(val, "ever2+sign", entropy_of(s * 32 + ev * 3 + ls) - entropy_of(ev * 3 + ls))
                add(
                    val,
                    "ever2+sign+mag",
                    entropy_of(s * 64 + (ev * 3 + ls) * 4 + lm) - entropy_of((ev * 3 + ls) * 4 + lm),
                )
                # magnitude-only (sign costs 1 bit): what a sign-blind code gets
                add(val, "relsign", entropy_of(np.abs(s) * 3 * 8 + np.where(ls == 1, 2, (np.sign(s) + 1 == ls)) * 8 + ev) - entropy_of(ev))
            # update history
            last[n][idx] = t
            if k:
                lsign[n][idx] = np.sign(s).astype(np.int8)
                lmag[n][idx] = np.minimum(np.abs(s), 100).astype(np.int8)
            if rows > 1:
                prev_row[n] = np.bincount(idx // cols, minlength=rows) / cols
                prev_col[n] = np.bincount(idx % cols, minlength=cols) / rows
        if record and changes:
            n_tot += changes
            for c, x in pos.items():
                pos_tot[c] = pos_tot.get(c, 0.0) + x
            for c, x in val.items():
                val_tot[c] = val_tot.get(c, 0.0) + x
            print(
                f"t={t} since={since} n={changes} pos none {pos['none'] / changes:.2f} prev2 {pos['prev2'] / changes:.2f} "
                f"ever2 {pos['ever2'] / changes:.2f} ever2+row {pos['ever2+row'] / changes:.2f} | val none {val['none'] / changes:.2f} "
                f"ever2+sign {val['ever2+sign'] / changes:.2f}",
                flush=True,
            )
    print(f"{args.trace}: {n_tot} changes over the steps with context (anchor every {A})")
    print("positions (bits/change):", ", ".join(f"{c} {x / n_tot:.3f}" for c, x in pos_tot.items()))
    print("values (bits/change):", ", ".join(f"{c} {x / n_tot:.3f}" for c, x in val_tot.items()))


if __name__ == "__main__":
    sys.exit(main())
