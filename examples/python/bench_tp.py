"""A tensor-parallel engine following a bucket: per version, the node's
work, every rank's prepare, the pause (the commit on every rank), and the
anchor, against reloading through the engine's own loader, in the same run.

    python examples/python/bench_tp.py --world 2 --params 2e8 --density 0.015

``--world`` worker processes (``torch.distributed`` with gloo; the engine's
tensors on the CPU, or with ``--device cuda`` on the GPU, every rank sharing it)
hold a Llama-like model with an MoE layer in vLLM's layout
(``python/tests/vllm_standin.py``: fused ``qkv_proj``/``gate_up_proj``,
column and row shards, padded vocabulary shards, stacked experts) and
follow a ``file://`` bucket through :class:`weightcast.node.TensorParallelFollower`
(one download per node; each rank patched in place). Each version changes
``--density`` of the elements (a relative 2^-6 nudge of random elements, so
every chosen element changes). Baseline per version: every rank reloads the
whole version through ``model.load_weights`` from the node's host copy (what
a loader path does). Prints one JSON object (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python", "tests"))


def config(params: float):
    from vllm_standin import Config

    # hidden h, 4 layers (one MoE with 4 experts): ~ (4 dense-ish layers of
    # 4·h² attention + 3·h·2h MLP) + 2 · vocab · h
    h = 256
    while True:
        c = Config(vocab=32000, hidden=h, layers=4, heads=h // 64, kv_heads=max(1, h // 256),
                   head_dim=64, inter=2 * h, experts=4, moe_layers=(3,))
        from vllm_standin import checkpoint_shapes

        n = sum(int(torch.tensor(s).prod()) for s in checkpoint_shapes(c).values())
        if n >= params or h >= 8192:
            return c, n
        h *= 2


def bits(t):
    """``t``'s elements as integers of their width (compared bit for bit)."""
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.detach().reshape(-1).view(ints[t.element_size()])


def worker(rank, a, url, state, root, init, out):
    import torch.distributed as dist

    import weightcast
    from vllm_standin import Engine, checkpoint_shapes
    from weightcast.node import TensorParallelFollower

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // a.world))
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=a.world)
    c, n = config(a.params)
    engine = Engine(c, a.world, rank).to(a.device)
    dev = torch.device(a.device)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    params = dict(engine.named_parameters())
    f = TensorParallelFollower(url if rank == 0 else None, params, engine.load_weights, root=root)
    g = torch.Generator().manual_seed(0)
    truth = None
    if rank == 0:
        truth = {k: (torch.randn(s, generator=g) * 0.02).bfloat16()
                 for k, s in checkpoint_shapes(c).items()}
        pub = weightcast.Publisher(url, state_dir=state, anchor_encoding="raw", anchor_every=1000)
    rows = []
    for v in range(a.versions + 1):
        if rank == 0:
            if v:
                for w in truth.values():
                    flat = w.view(-1)
                    idx = torch.randint(0, flat.numel(), (max(1, int(flat.numel() * a.density)),),
                                        generator=g)
                    flat[idx] = flat[idx] * (1 + 2.0**-6) + 1e-4
            pub.publish(truth, step=v)
        dist.barrier()
        t = time.perf_counter()
        r = f.step()
        step_s = time.perf_counter() - t
        assert r.committed and r.version == v, r
        # the baseline: reload the whole version through the engine's loader
        dist.barrier()
        host = f.rank_follower.host
        arrays = host.arrays(writable=False)
        followed = {k: p.detach().clone() for k, p in params.items()}
        t = time.perf_counter()
        from weightcast._tensors import _TORCH_DTYPES

        inv = {v2: k2 for k2, v2 in _TORCH_DTYPES.items()}
        weights = ((k, torch.from_numpy(arrays[k].view("int16")).view(getattr(torch, inv[d]))
                    .view(*s)) for k, (d, s, _) in host.index().items())
        engine.load_weights(weights)
        sync()
        reload_s = time.perf_counter() - t
        # what the follower patched in place equals that reload, bit for bit
        same = all(torch.equal(bits(followed[k]), bits(p)) for k, p in params.items())
        del arrays, followed
        times = [None] * a.world
        node_phases = dict(getattr(f.node, "phases", {})) if f.node is not None else {}
        dist.all_gather_object(times, (step_s, r.prepare_seconds, r.pause_seconds, reload_s,
                                       r.node_seconds, dict(f.rank_follower.prepare_phases), same,
                                       node_phases))
        rows.append((r.op, times))
    if rank == 0:
        deltas = [t for op, t in rows if op == "patch"]
        med = lambda i: statistics.median(max(x[i] for x in t) for t in deltas)  # noqa: E731
        anchor = rows[0][1]
        report = {
            "world": a.world, "device": a.device, "params": n, "model_bytes": 2 * n, "density": a.density,
            "versions": a.versions, "cpu_count": os.cpu_count(), "loadavg": os.getloadavg(),
            "anchor_step_s": round(max(x[0] for x in anchor), 4),
            "anchor_reload_s": round(max(x[3] for x in anchor), 4),
            "anchor_pause_s": round(max(x[2] for x in anchor), 4),
            "anchor_prepare_s": round(max(x[1] for x in anchor), 4),
            "anchor_over_reload": round(max(x[2] for x in anchor) / max(x[3] for x in anchor), 2),
            "delta_step_s": round(med(0), 4),
            "delta_node_s": round(med(4), 4),
            "delta_prepare_s": round(med(1), 4),
            "delta_pause_s": round(med(2), 4),
            "reload_s": round(med(3), 4),
            "reload_over_pause": round(med(3) / med(2), 1),
            "prepare_over_reload": round(med(1) / med(3), 3),
            "delta_prepare_phases": [[{k: round(v, 4) for k, v in x[5].items()} for x in t]
                                     for t in deltas],
            "delta_node_phases": [{k: round(v, 4) for k, v in t[0][7].items()} for t in deltas],
            "bit_identical_to_reload": all(x[6] for _, t in rows for x in t),
            "downloads_per_version": sorted(set(x[0] for x in f.node.downloaded.values())),
            "download_bytes": {k: b for k, (_, b) in f.node.downloaded.items()},
        }
        with open(out, "w") as fh:
            json.dump(report, fh)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--params", type=float, default=2e8)
    ap.add_argument("--density", type=float, default=0.015)
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="where the engine's tensors live (cpu, cuda)")
    a = ap.parse_args()
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="wc-tp-") as d, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        s.close()
        root = f"/dev/shm/wc-tp-{os.getpid()}"
        out = os.path.join(d, "report.json")
        try:
            mp.spawn(worker, args=(a, f"file://{d}/bucket", f"{d}/state", root, init, out),
                     nprocs=a.world, join=True)
        finally:
            import shutil

            shutil.rmtree(root, ignore_errors=True)
        print(json.dumps(json.load(open(out)), indent=1))


if __name__ == "__main__":
    main()
