#!/usr/bin/env python3
"""Distributed publish on one host (issue 27, item 5): W ranks against one publisher.

Writes `bench_e2e.py`'s bf16 model in W shard files, and gives rank R a
directory holding hard links to its own shard and to `config.json` (the
trainer's FSDP layout: each rank saves its own shard file). Each version,
every shard steps in place (`--density` of its elements move by one ulp),
and then, timed against each other in the same run:

- **W ranks**: W `weightcast publish --rank R --world W --step S` processes
  started together, each with its own `--state`; the version is committed
  when the last one returns (each rank's own wall and CPU seconds too);
- **one publisher**: a single `weightcast publish` of the whole checkpoint
  into another prefix (the baseline), its own `--state`;
- **catch-up**: `weightcast subscribe --once` of each prefix's new version
  into its own output (one version behind);
- **reading the checkpoint once** from the page cache (`cat`, best of two),
  and reading one rank's shard once.

The first version is an anchor; the medians are over the deltas after it.
The store is a `file://` bucket under `--work` (tmpfs by default: the
benchmark times the ranks' work, not a network). Seconds per TB of model:
a publish's wall time divided by the terabytes each rank holds (the
model's over W), and a catch-up's by the model's terabytes.

    cargo build --release
    python3 scripts/bench_dist.py --elements 1e9 --world 4 --density 0.015,0.03 \\
        --versions 4 --work /dev/shm/wcdist --json docs/bench/dist-w4-1e9.json

Needs numpy. Memory under `--work`: the checkpoint, W + 1 publisher
snapshots (one model's worth in all, twice), the bucket, two subscribers'
two slots each: about 8x the model's bytes (each density's are removed
before the next).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from bench_e2e import cat_seconds, shard_name, step_model, write_model  # noqa: E402


def read_seconds(files: list[Path]) -> float:
    """Reading `files` once from the page cache: best of two after a warm-up."""
    def once() -> float:
        t = time.perf_counter()
        subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)
        return time.perf_counter() - t

    once()
    return min(once(), once())


def run_all(cmds: list[list[str]], env: dict) -> dict:
    """Starts the commands together; waits for all. Wall of the slowest,
    each one's wall, the CPU seconds of all, and each one's JSON line."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    ps = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
          for c in cmds]
    walls, outs = [None] * len(ps), [None] * len(ps)
    left = set(range(len(ps)))
    while left:
        for i in list(left):
            if ps[i].poll() is not None:
                walls[i] = time.perf_counter() - t
                left.discard(i)
        time.sleep(0.002)
    for i, p in enumerate(ps):
        out, err = p.communicate()
        if p.returncode != 0:
            sys.exit(f"`{' '.join(cmds[i])}` failed ({p.returncode}):\n{err}")
        outs[i] = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"seconds": max(walls), "each_s": walls, "cpu_s": cpu, "json": outs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", type=float, default=1e9)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--density", default="0.015,0.03", help="comma separated")
    ap.add_argument("--versions", type=int, default=4, help="deltas per density")
    ap.add_argument("--work", default="/dev/shm/wcdist")
    ap.add_argument("--bin", default=str(ROOT / "target/release/weightcast"))
    ap.add_argument("--json")
    a = ap.parse_args()
    w, elements = a.world, int(a.elements)
    work = Path(a.work)
    shutil.rmtree(work, ignore_errors=True)
    ckpt = work / "ckpt"
    write_model(ckpt, elements, w, seed=1)
    model_bytes = sum(p.stat().st_size for p in ckpt.glob("model-*.safetensors"))
    for r in range(w):
        d = work / f"rank-{r}"
        d.mkdir()
        os.link(ckpt / shard_name(r, w), d / shard_name(r, w))
        os.link(ckpt / "config.json", d / "config.json")
    bucket = (work / "bucket").as_uri()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WEIGHTCAST_", "AWS_"))}
    env["RUST_LOG"] = "weightcast=warn"
    rng = np.random.default_rng(7)
    rows = []
    step = 0
    for density in [float(x) for x in a.density.split(",")]:
        # A fresh prefix per density: its first version is an anchor.
        tag = f"d{density:g}".replace(".", "p")
        ranks = [[a.bin, "publish", "--quiet", "--store", f"{bucket}/{tag}-ranks",
                  "--state", str(work / f"state-{tag}-{r}"), "--checkpoint", str(work / f"rank-{r}"),
                  "--rank", str(r), "--world", str(w), "--anchor-every", "1000"] for r in range(w)]
        single = [a.bin, "publish", "--quiet", "--store", f"{bucket}/{tag}-one",
                  "--state", str(work / f"state-{tag}-one"), "--checkpoint", str(ckpt),
                  "--anchor-every", "1000"]
        subs = {k: [a.bin, "subscribe", "--once", "--quiet", "--store", f"{bucket}/{tag}-{k}",
                    "--out", str(work / f"out-{tag}-{k}")] for k in ("ranks", "one")}
        for v in range(a.versions + 1):
            if v > 0 or step > 0:
                changed = step_model(ckpt, density, rng, step)
            else:
                changed = 0
            read_once = cat_seconds(ckpt)
            read_shard = read_seconds([ckpt / shard_name(0, w)])
            pr = run_all([c + ["--step", str(step)] for c in ranks], env)
            po = run_all([single], env)
            cr = run_all([subs["ranks"]], env)
            co = run_all([subs["one"]], env)
            versions = {j.get("version") for j in pr["json"]}
            if len(versions) != 1 or po["json"][0].get("version") != v:
                sys.exit(f"the ranks committed {versions}, the single publisher "
                         f"{po['json'][0].get('version')}; expected {v}")
            row = {"density": density, "version": v, "kind": po["json"][0].get("kind"),
                   "changed": changed, "read_once_s": read_once, "read_shard_s": read_shard,
                   "ranks_publish_s": pr["seconds"], "ranks_each_s": pr["each_s"],
                   "ranks_cpu_s": pr["cpu_s"], "ranks_bytes": sum(j.get("bytes", 0) for j in pr["json"]),
                   "one_publish_s": po["seconds"], "one_cpu_s": po["cpu_s"],
                   "one_bytes": po["json"][0].get("bytes"),
                   "ranks_catch_up_s": cr["seconds"], "one_catch_up_s": co["seconds"]}
            print(json.dumps(row), flush=True)
            rows.append(row)
            step += 1
        # Room on tmpfs for the next density.
        for p in work.glob(f"*{tag}*"):
            shutil.rmtree(p, ignore_errors=True)
        shutil.rmtree(work / "bucket", ignore_errors=True)
    tb = model_bytes / 1e12
    summary = {"elements": elements, "model_bytes": model_bytes, "world": w, "densities": {}}
    for density in sorted({r["density"] for r in rows}):
        ds = [r for r in rows if r["density"] == density and r["version"] > 0]
        med = lambda k: statistics.median(r[k] for r in ds)
        s = {k: med(k) for k in ("ranks_publish_s", "one_publish_s", "ranks_catch_up_s",
                                 "one_catch_up_s", "read_once_s", "read_shard_s", "ranks_cpu_s",
                                 "one_cpu_s", "ranks_bytes", "one_bytes", "changed")}
        s["ranks_vs_one"] = s["one_publish_s"] / s["ranks_publish_s"]
        s["ranks_publish_vs_read_once"] = s["ranks_publish_s"] / s["read_once_s"]
        # Per TB of model: a rank holds tb / w of it; a subscriber all of it.
        s["ranks_publish_s_per_tb_per_rank"] = s["ranks_publish_s"] / (tb / w)
        s["one_publish_s_per_tb"] = s["one_publish_s"] / tb
        s["catch_up_s_per_tb"] = s["ranks_catch_up_s"] / tb
        summary["densities"][str(density)] = s
    print(json.dumps(summary, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps({"summary": summary, "rows": rows}, indent=1) + "\n")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
