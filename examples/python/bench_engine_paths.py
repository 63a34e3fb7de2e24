"""The engine's pause per version on each hand-off path of
docs/integrations.md, on CPU stand-ins, in one run.

    python examples/python/bench_engine_paths.py --params 1e8 --density 0.015

A bf16 model of --params parameters (tensors of 2048 x 2048) is published
as version 0; each engine starts from it. Each step nudges --density of
every tensor's elements and is published as a delta; every engine follows
it. The pause is the Follower's ``pause_seconds`` ("update downloaded" to
"engine holds the version"):

- in place: ``Follower(params=engine)`` — prepared while serving
  (``prepare_seconds``, not a pause), the pause is the commit;
- loader: ``Follower(loader=model.load_weights)`` — the delta applied to the
  host copy, then the changed tensors loaded whole (one ``copy_`` each, as
  vLLM's default loader ends);
- sparse: ``Follower(loader, patcher=...)`` — the delta applied to the host
  copy keeping its positions, then vLLM's ``load_checkpoint_weight_patches``
  contract (a NaN-filled checkpoint-shaped tensor per changed tensor, the
  values at their indices, a ``copy_`` that keeps the destination at NaN),
  here by an independent CPU implementation: the cost shape of vLLM's, not
  its figures;
- reload from files: the version materialized (``Update.save_to``, what the
  CLI subscriber writes before its hooks run; not in the pause), then
  ``safetensors.torch.load_file`` + ``copy_`` (what an engine's
  ``update_weights_from_disk`` / ``reload_weights`` does, minus the GPU),
  file in the page cache.

Every engine is checked bit-identical to the trainer. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import tempfile
import time
from typing import Any, List

import torch

import weightcast
from weightcast.engine import Follower, Patch


class Model:
    """An engine's model with vLLM's ``load_weights`` (each tensor copied
    into the parameter of its name)."""

    def __init__(self, tensors):
        self.tensors = {k: torch.empty_like(v) for k, v in tensors.items()}

    def load_weights(self, weights):
        for name, t in weights:
            self.tensors[name].copy_(t)
        return {n for n, _ in weights}


def patch_contract(model: Model, patches: List[Patch]) -> Any:
    """vLLM's load_checkpoint_weight_patches contract for sparse patches,
    reimplemented for CPU (see the module's docstring)."""
    plain = torch.Tensor.copy_
    weights = []
    for p in patches:
        full = torch.full((math.prod(p.shape),), float("nan"), dtype=p.dtype)
        full.index_copy_(0, p.indices, p.values)
        weights.append((p.name, full.view(p.shape)))

    def keep_nan(dst, src, non_blocking=False):
        return plain(dst, torch.where(torch.isnan(src), dst, src))

    torch.Tensor.copy_ = keep_nan
    try:
        return model.load_weights(weights)
    finally:
        torch.Tensor.copy_ = plain


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=1e8)
    ap.add_argument("--density", type=float, default=0.015)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    root = tempfile.mkdtemp(prefix="wc-paths-", dir=a.dir)
    try:
        run(a, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(a: argparse.Namespace, root: str) -> None:
    from safetensors.torch import load_file

    side = 2048
    n = max(1, round(a.params / (side * side)))
    g = torch.Generator().manual_seed(0)
    trainer = {f"layers.{i}.weight": (torch.randn(side, side, generator=g) * 0.02).bfloat16()
               for i in range(n)}
    url = f"file://{root}/bucket"
    pub = weightcast.Publisher(url, state_dir=f"{root}/state", anchor_encoding="raw")
    pub.publish(trainer, step=0)

    inplace_engine = {k: torch.empty_like(v) for k, v in trainer.items()}
    loader_model, sparse_model = Model(trainer), Model(trainer)
    reload_engine = {k: torch.empty_like(v) for k, v in trainer.items()}
    followers = {
        "in_place": Follower(url, params=inplace_engine),
        "loader": Follower(url, loader=loader_model.load_weights),
        "sparse": Follower(url, loader=sparse_model.load_weights,
                           patcher=lambda ps: patch_contract(sparse_model, ps)),
    }
    for f in followers.values():
        assert f.step()["kind"] == "anchor"
    u = weightcast.Subscriber(url).poll()
    u.apply_to(reload_engine)
    out_dir = f"{root}/out"
    u.save_to(out_dir)
    path = os.path.join(out_dir, "current", "model.safetensors")

    per = int(side * side * a.density)
    pauses = {k: [] for k in (*followers, "reload")}
    prepare, changed = [], 0
    for step in range(1, a.repeats + 1):
        for w in trainer.values():
            idx = torch.randint(0, side * side, (per,), generator=g)
            flat = w.view(-1)
            flat[idx] = flat[idx] * (1 + 2.0**-6) + 1e-4
        out = pub.publish(trainer, step=step)
        assert out["kind"] == "delta", out
        changed = out["changed"]
        for name, f in followers.items():
            r = f.step()
            assert r["version"] == step, (name, r)
            pauses[name].append(r["pause_seconds"])
            if name == "in_place":
                prepare.append(r["prepare_seconds"])
        # save_to does not advance a Subscriber (apply_to does): follow
        # the directory with a subscriber that holds the previous version.
        u = weightcast.Subscriber(url, version=step - 1).poll()
        assert u.version == step, u
        u.save_to(out_dir)  # before the hooks run: not in the pause
        load_file(path)  # into the page cache
        t = time.perf_counter()
        for k, v in load_file(path).items():
            reload_engine[k].copy_(v)
        pauses["reload"].append(time.perf_counter() - t)
    engines = {"in_place": inplace_engine, "loader": loader_model.tensors,
               "sparse": sparse_model.tensors, "reload": reload_engine}
    for name, engine in engines.items():
        differ = [k for k in trainer if not torch.equal(engine[k], trainer[k])]
        assert not differ, f"{name}: not bit-identical: {differ[:3]}"
    med = {k: statistics.median(v) for k, v in pauses.items()}
    print(json.dumps({
        "params": n * side * side,
        "model_bytes": n * side * side * 2,
        "tensors": n,
        "changed_per_version": changed,
        "density": changed / (n * side * side),
        "pause_s": {k: [round(x, 4) for x in v] for k, v in pauses.items()},
        "pause_median_s": {k: round(v, 4) for k, v in med.items()},
        "in_place_prepare_s": [round(x, 4) for x in prepare],
        "reload_over": {k: round(med["reload"] / v, 2) for k, v in med.items()},
        "loadavg_at_end": os.getloadavg(),
        "torch_threads": torch.get_num_threads(),
    }, indent=1))


if __name__ == "__main__":
    main()
