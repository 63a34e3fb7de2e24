"""Where a publish from changes found on the device goes, on any machine.

A bf16 model of --params parameters (tensors of 4096 x 4096) is published as
an anchor, then --versions deltas of --density changed elements each, every
one through ``diff_on_device=True`` (on CPU tensors here unless --device
cuda). Prints each version's phases (``Publisher.last_phases``): the compare
where the tensors are (``device_diff_s``), the changes to the host
(``to_host_s``), the library's encoding (``encode_s``) and its whole publish
(``native_s``).

    python examples/python/bench_publish_changes.py --params 2.7e8 --dir /dev/shm/wc
"""

import argparse
import json
import shutil
import time

import torch

import weightcast


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=2.7e8)
    ap.add_argument("--density", type=float, default=0.014)
    ap.add_argument("--versions", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dir", default="/tmp/wc-publish-changes",
                    help="bucket and publisher state (removed first)")
    a = ap.parse_args()
    shutil.rmtree(a.dir, ignore_errors=True)
    side = 4096
    g = torch.Generator().manual_seed(0)
    tensors = {f"layers.{i}.weight": (torch.randn(side, side, generator=g) * 0.02).bfloat16()
               .to(a.device) for i in range(max(1, round(a.params / side**2)))}
    pub = weightcast.Publisher(f"file://{a.dir}/bucket", state_dir=f"{a.dir}/state",
                               anchor_encoding="raw", anchor_every=10**6, diff_on_device=True)
    pub.publish(tensors, step=0)
    for step in range(1, a.versions + 1):
        for w in tensors.values():
            flat = w.view(-1)
            idx = torch.randint(0, flat.numel(), (int(flat.numel() * a.density),),
                                generator=g).to(a.device)
            flat[idx] = flat[idx] * (1 + 2.0**-6) + 1e-4
        t = time.perf_counter()
        out = pub.publish(tensors, step=step)
        took = time.perf_counter() - t
        print(json.dumps({"version": out["version"], "kind": out["kind"],
                          "publish_s": round(took, 4),
                          **{k: (round(v, 4) if isinstance(v, float) else v)
                             for k, v in pub.last_phases.items()},
                          "changed": out["changed"]}))
    shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
