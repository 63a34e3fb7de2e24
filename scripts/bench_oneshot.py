#!/usr/bin/env python3
"""One-shot commands in steady state (issue 27): `weightcast publish` and
`weightcast subscribe --once`, one process per version, against a page-cache
read of the checkpoint, and the bytes each writes locally.

The model is `bench_e2e.py`'s: a bf16 checkpoint of `--shards` files (random
N(0, 0.02) weights, tensors of at most 64 Mi elements), stepped in place
between versions (`--density` of the elements flip their lowest bit). Per
version, in this order:

1. the step (numpy, in place), then the baseline: `cat` of the checkpoint's
   tensor files from the page cache, best of two after a warm-up;
2. `weightcast publish` (a new process), timed;
3. `weightcast subscribe --once` (a new process), timed;

each with the process's own `/proc/<pid>/io` `write_bytes` (what it sent to
the storage layer; 0 on tmpfs) read just before it exits (the JSON's
`local_write_bytes` when the binary reports it), and, with `--disk DEV`, the
sectors DEV wrote from `/proc/diskstats` around the command and a `sync`
(the disk's own count: what actually reached it, including write-back of
pages the command dirtied). The first version is an anchor and a bootstrap;
`--versions` deltas follow. The summary is the median over the deltas from
`--skip` on (steady state: the subscriber's standby slot exists).

    python3 scripts/bench_oneshot.py --elements 1e9 --versions 6 \\
        --ckpt /dev/shm/wc1/ckpt --bucket /dev/shm/wc1/bucket \\
        --state /dev/shm/wc1/state --out /dev/shm/wc1/out --json /tmp/oneshot-tmpfs.json
    python3 scripts/bench_oneshot.py --elements 1e9 --versions 6 \\
        --ckpt /dev/shm/wc2/ckpt --bucket /dev/shm/wc2/bucket \\
        --state /tmp/wc2/state --out /dev/shm/wc2/out --disk vda --json /tmp/oneshot-ext4.json

Needs `cargo build --release --bin weightcast` and numpy. Removes nothing it
did not create; `--clean` removes the four directories at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_e2e import cat_seconds, step_model, write_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def sectors_written(dev: str) -> int:
    with open("/proc/diskstats") as f:
        for line in f:
            p = line.split()
            if p[2] == dev:
                return int(p[9])
    sys.exit(f"no device {dev} in /proc/diskstats")


def run(cmd: list[str], env: dict, disk: str | None) -> dict:
    """Runs `cmd` to its end: seconds, its JSON line, its write_bytes, the disk's bytes."""
    if disk:
        subprocess.run(["sync"], check=True)
        before = sectors_written(disk)
    t = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    io = {}
    # Read /proc/<pid>/io while it runs (the last reading before it exits).
    while p.poll() is None:
        try:
            with open(f"/proc/{p.pid}/io") as f:
                io = {k: int(v) for k, v in (line.split(": ") for line in f)}
        except OSError:
            pass
        time.sleep(0.005)
    secs = time.perf_counter() - t
    out, err = p.communicate()
    if p.returncode != 0:
        sys.exit(f"`{' '.join(cmd)}` failed ({p.returncode}):\n{err}")
    r = {"seconds": secs, "json": json.loads(out.strip().splitlines()[-1]),
         "proc_write_bytes": io.get("write_bytes", 0)}
    if disk:
        subprocess.run(["sync"], check=True)
        r["disk_bytes"] = (sectors_written(disk) - before) * 512
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--elements", type=float, default=1e9)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--density", type=float, default=0.015)
    ap.add_argument("--versions", type=int, default=6, help="deltas after the anchor")
    ap.add_argument("--skip", type=int, default=2, help="deltas left out of the medians")
    ap.add_argument("--ckpt", type=Path, required=True)
    ap.add_argument("--bucket", type=Path, required=True)
    ap.add_argument("--state", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--disk", help="block device for /proc/diskstats (e.g. vda)")
    ap.add_argument("--bin", default=str(ROOT / "target/release/weightcast"))
    ap.add_argument("--publish-args", default="", help="extra flags for publish")
    ap.add_argument("--step-dirs", action="store_true",
                    help="each version in a directory of its own under --ckpt, the last two kept "
                         "(a trainer with save_total_limit=2; what --state-mode previous needs), "
                         "written and synced before the publish is timed")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--clean", action="store_true")
    a = ap.parse_args()

    for d in (a.ckpt, a.bucket, a.state, a.out):
        if d.exists():
            sys.exit(f"{d} exists; give fresh directories")
    env = dict(os.environ, RUST_LOG="warn")
    store = f"file://{a.bucket}"
    a.bucket.mkdir(parents=True)
    first = a.ckpt / "step-0" if a.step_dirs else a.ckpt
    write_model(first, int(a.elements), a.shards, seed=1)
    rng = np.random.default_rng(2)
    publish = [a.bin, "publish", "--quiet", "--store", store, "--state", str(a.state),
               *a.publish_args.split(), "--checkpoint"]
    once = [a.bin, "subscribe", "--once", "--quiet", "--store", store, "--out", str(a.out)]
    rows = []
    try:
        ckpt = first
        for v in range(a.versions + 1):
            if a.step_dirs and v:
                if v >= 2:
                    shutil.rmtree(a.ckpt / f"step-{v - 2}")
                shutil.copytree(ckpt, a.ckpt / f"step-{v}")
                ckpt = a.ckpt / f"step-{v}"
            changed = step_model(ckpt, a.density, rng, v) if v else 0
            if a.step_dirs:
                os.sync()  # the trainer's write is not the publisher's
            read = cat_seconds(ckpt)
            pub = run(publish + [str(ckpt)], env, a.disk)
            sub = run(once, env, a.disk)
            row = {
                "version": v, "changed": changed, "read_s": read,
                "publish_s": pub["seconds"], "publish": pub["json"],
                "publish_proc_write_bytes": pub["proc_write_bytes"],
                "publish_disk_bytes": pub.get("disk_bytes"),
                "once_s": sub["seconds"], "once": sub["json"],
                "once_proc_write_bytes": sub["proc_write_bytes"],
                "once_disk_bytes": sub.get("disk_bytes"),
            }
            rows.append(row)
            mb = lambda b: "-" if b is None else f"{b / 1e6:.1f} MB"
            print(f"v{v} {pub['json'].get('kind')}: read {read:.3f} s | publish {pub['seconds']:.2f} s "
                  f"({pub['seconds'] / read:.2f}x, delta {pub['json'].get('bytes', 0) / 1e6:.1f} MB, "
                  f"wrote {mb(pub['proc_write_bytes'])}, disk {mb(pub.get('disk_bytes'))}) | "
                  f"--once {sub['seconds']:.2f} s ({sub['seconds'] / read:.2f}x, "
                  f"wrote {mb(sub['proc_write_bytes'])}, disk {mb(sub.get('disk_bytes'))})", flush=True)
    finally:
        if a.clean:
            for d in (a.ckpt, a.bucket, a.state, a.out):
                shutil.rmtree(d, ignore_errors=True)
    steady = rows[1 + a.skip:]
    med = lambda k: statistics.median(r[k] for r in steady) if steady else None
    summary = {
        "elements": a.elements, "density": a.density, "versions": a.versions, "skip": a.skip,
        "read_s": med("read_s"),
        "publish_ratio": statistics.median(r["publish_s"] / r["read_s"] for r in steady),
        "once_ratio": statistics.median(r["once_s"] / r["read_s"] for r in steady),
        "publish_s": med("publish_s"), "once_s": med("once_s"),
        "delta_bytes": statistics.median(r["publish"]["bytes"] for r in steady),
        "publish_proc_write_bytes": med("publish_proc_write_bytes"),
        "once_proc_write_bytes": med("once_proc_write_bytes"),
    }
    if a.disk:
        summary["publish_disk_bytes"] = med("publish_disk_bytes")
        summary["once_disk_bytes"] = med("once_disk_bytes")
    print(json.dumps(summary))
    if a.json:
        a.json.write_text(json.dumps({"summary": summary, "rows": rows, "args": vars(a)}, default=str, indent=1))


if __name__ == "__main__":
    main()
