"""The engine's pause per version: in-place apply versus reloading the
materialized file into the same tensors, in the same run.

    python examples/python/bench_pause.py --params 1e9 --density 0.015
    python examples/python/bench_pause.py --params 1e9 --device cuda   # an engine on a GPU
    python examples/python/bench_pause.py --params 1e8 --via scatter   # the device path on CPU tensors

A bf16 model of --params parameters (tensors of 4096 x 4096) is published
(version 0, an anchor) into a file:// bucket under --dir; the engine holds a
copy of it. A training step changes --density of the elements and is
published as version 1 (a delta). Then, on the engine side:

- in place: ``Update.apply_to(engine)`` (verify, then write into the
  engine's tensors); the pause is from "update downloaded" (``poll``
  returned) to "engine holds the new version";
- single pass: ``apply_to(engine, single_pass=True)``;
- prepared: ``Update.prepare(engine)`` while the engine serves (verify and
  decode; timed, not a pause), then ``Update.commit()`` (the pause: the
  writes alone);
- reload: the version materialized as a file (``Update.save_to``, what
  ``weightcast subscribe --out`` writes), then ``safetensors.torch.load_file``
  + ``copy_`` into the same tensors, with the file in the page cache (read
  once before timing).

``--device cuda`` puts the engine's tensors on the GPU: the in-place paths
go through the device path (old words gathered there, checked by the
library, new words scattered there: ``via="scatter"``), the anchor is
copied onto the device tensors (timed: ``anchor_s``), the reload copies the
loaded file into them, and the floor is a torch ``index_copy_`` of the same
changes already on the device (``index_copy_floor_s``). ``--via scatter``
takes the device path on CPU tensors.

Also printed: bytes each path writes to the node's disk for a version
(``/proc/self/io`` write_bytes; for the file path the first version into an
empty output directory and a later one into the directory holding an
earlier one) and the update's size against the model
(the subscriber's extra memory). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch

import weightcast


def write_bytes() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("write_bytes:"):
                return int(line.split()[1])
    return 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=1e9)
    ap.add_argument("--density", type=float, default=0.015)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="scratch directory (on disk, not tmpfs)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu", help="where the engine's tensors live (cpu, cuda)")
    ap.add_argument("--via", default="auto", choices=["auto", "buffers", "scatter"],
                    help="the in-place path (auto: buffers on the CPU, scatter on a device)")
    ap.add_argument("--publish-from-device", action="store_true",
                    help="also time publishing from the engine's device (always on cuda)")
    ap.add_argument("--bucket-dir", default=None,
                    help="where the bucket and the publisher's state go (e.g. /dev/shm; "
                         "default: the scratch directory)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    root = tempfile.mkdtemp(prefix="wc-bench-", dir=a.dir)
    store = tempfile.mkdtemp(prefix="wc-bench-", dir=a.bucket_dir) if a.bucket_dir else root
    try:
        run(a, root, store)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(store, ignore_errors=True)


def run(a: argparse.Namespace, root: str, store: str) -> None:
    side = 4096
    n = max(1, round(a.params / (side * side)))
    g = torch.Generator().manual_seed(0)
    trainer = {f"layers.{i}.weight": (torch.randn(side, side, generator=g) * 0.02).bfloat16()
               for i in range(n)}
    params = n * side * side
    model_bytes = params * 2
    dev = torch.device(a.device)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    engine = {k: torch.empty_like(v, device=dev) for k, v in trainer.items()}
    via = a.via
    url = f"file://{store}/bucket"
    pub = weightcast.Publisher(url, state_dir=f"{store}/state", anchor_encoding="raw",
                               anchor_every=10**6)
    t = time.perf_counter()
    pub.publish(trainer, step=0)
    publish_anchor_s = time.perf_counter() - t
    sub = weightcast.Subscriber(url)
    anchor = sub.poll()  # the engine starts from version 0's anchor
    sync()
    t = time.perf_counter()
    anchor.apply_to(engine, via=via)
    sync()
    anchor_s = time.perf_counter() - t
    del anchor

    # one training step at the given density: random elements nudged by a
    # relative 2^-6 (a bf16 value that always changes)
    per = int(side * side * a.density)

    def train_step() -> None:
        for w in trainer.values():
            idx = torch.randint(0, side * side, (per,), generator=g)
            flat = w.view(-1)
            flat[idx] = flat[idx] * (1 + 2.0**-6) + 1e-4

    train_step()
    t = time.perf_counter()
    out = pub.publish(trainer, step=1)
    publish_delta_s = time.perf_counter() - t
    assert out["kind"] == "delta", out

    t = time.perf_counter()
    update = sub.poll()
    download_s = time.perf_counter() - t
    assert update is not None and update.kind == "delta"

    # the floor: a torch index_copy_ of the same changes, already where the
    # engine's tensors are (applied to copies, so the engine keeps version 0)
    floor = 0.0
    for k, v in trainer.items():
        old_words = engine[k].view(-1).view(torch.int16)
        new_words = v.to(dev).view(-1).view(torch.int16)
        pos = (old_words != new_words).nonzero().flatten()
        vals = new_words[pos]
        scratch = old_words.clone()
        sync()
        t = time.perf_counter()
        scratch.index_copy_(0, pos, vals)
        sync()
        floor += time.perf_counter() - t
        del scratch

    # in place: the pause is apply_to (the update is downloaded)
    w0 = write_bytes()
    t = time.perf_counter()
    report = update.apply_to(engine, via=via)
    sync()
    inplace_s = time.perf_counter() - t
    inplace_written = write_bytes() - w0
    assert all(torch.equal(engine[k].cpu(), trainer[k]) for k in trainer), "not bit-identical"

    # reload: the file the CLI subscriber materializes, then load_file + copy_
    from safetensors.torch import load_file

    out_dir = f"{root}/out"
    w0 = write_bytes()
    t = time.perf_counter()
    update.save_to(out_dir)
    materialize_s = time.perf_counter() - t
    materialize_written = write_bytes() - w0
    path = os.path.join(out_dir, "current", "model.safetensors")
    load_file(path)  # into the page cache
    reload = []
    for _ in range(a.repeats):
        t = time.perf_counter()
        loaded = load_file(path)
        for k, v in loaded.items():
            engine[k].copy_(v)
        sync()
        reload.append(time.perf_counter() - t)
        del loaded
    assert all(torch.equal(engine[k].cpu(), trainer[k]) for k in trainer)

    # in place again (repeats), on fresh copies of version 0's changed elements:
    # re-publish the same step pattern twice more and apply each
    more = []
    for step in range(2, 2 + a.repeats - 1):
        train_step()
        pub.publish(trainer, step=step)
        u = sub.poll()
        t = time.perf_counter()
        u.apply_to(engine, via=via)
        sync()
        more.append(time.perf_counter() - t)
    same = lambda: all(torch.equal(engine[k].cpu(), trainer[k]) for k in trainer)  # noqa: E731
    assert same()
    # the single-pass apply (write, check, put back on failure): CPU buffers
    single = []
    for step in range(2 + a.repeats - 1, 2 + 2 * (a.repeats - 1) + 1):
        train_step()
        pub.publish(trainer, step=step)
        u = sub.poll()
        t = time.perf_counter()
        r = u.apply_to(engine, single_pass=dev.type == "cpu" and via != "scatter", via=via)
        sync()
        single.append(time.perf_counter() - t)
    assert same()
    # prepared: verify and decode while the engine serves (not a pause), then
    # the pause is the commit alone
    prepare, commit, phases = [], [], []
    first = 2 + 2 * (a.repeats - 1) + 1
    for step in range(first, first + a.repeats):
        train_step()
        pub.publish(trainer, step=step)
        u = sub.poll()
        t = time.perf_counter()
        assert u.prepare(engine, via=via)
        sync()
        prepare.append(time.perf_counter() - t)
        phases.append(dict(weightcast._device.last))
        t = time.perf_counter()
        r = u.commit()
        sync()
        commit.append(time.perf_counter() - t)
    assert same()
    # the file path in steady state: the newest version materialized into the
    # output directory that holds an earlier one (the standby slot patched)
    w0 = write_bytes()
    t = time.perf_counter()
    u.save_to(out_dir)
    steady_s = time.perf_counter() - t
    steady_written = write_bytes() - w0
    device_publish = {}
    if dev.type == "cuda" or a.publish_from_device:
        try:
            device_publish = publish_from_device(a, pub, trainer, dev, sync, first + a.repeats)
        except Exception as e:  # the engine side's figures still print
            device_publish = {"publish_from_device_error": repr(e)}
    inplace_all = [inplace_s] + more
    ip, rl = statistics.median(inplace_all), statistics.median(reload)
    print(json.dumps({
        "params": params,
        "model_bytes": model_bytes,
        "tensors": n,
        "density": out["changed"] / out["total"],
        "changed": out["changed"],
        "delta_bytes": update.nbytes,
        "subscriber_extra_memory_fraction": update.nbytes / model_bytes,
        "publish_anchor_s": round(publish_anchor_s, 3),
        "publish_delta_s": round(publish_delta_s, 3),
        "download_s": round(download_s, 3),
        "inplace_pause_s": [round(x, 4) for x in inplace_all],
        "reload_pause_s": [round(x, 4) for x in reload],
        "inplace_median_s": round(ip, 4),
        "reload_median_s": round(rl, 4),
        "reload_over_inplace": round(rl / ip, 2),
        "single_pass_pause_s": [round(x, 4) for x in single],
        "single_pass_median_s": round(statistics.median(single), 4),
        "reload_over_single_pass": round(rl / statistics.median(single), 2),
        "prepare_s": [round(x, 4) for x in prepare],
        "prepare_phases_s": [{k: round(v, 4) for k, v in p.items()} for p in phases],
        "commit_pause_s": [round(x, 4) for x in commit],
        "commit_median_s": round(statistics.median(commit), 4),
        "reload_over_commit": round(rl / statistics.median(commit), 2),
        "device": str(dev),
        "via": via,
        "anchor_s": round(anchor_s, 4),
        "anchor_over_reload": round(anchor_s / rl, 2),
        "index_copy_floor_s": round(floor, 5),
        "commit_over_floor": round(statistics.median(commit) / floor, 2) if floor else None,
        "prepare_over_reload": round(statistics.median(prepare) / rl, 3),
        "inplace_disk_bytes_written": inplace_written,
        "materialize_first_s": round(materialize_s, 3),
        "materialize_first_disk_bytes_written": materialize_written,
        "materialize_next_s": round(steady_s, 3),
        "materialize_next_disk_bytes_written": steady_written,
        "loadavg_at_end": os.getloadavg(),
        "apply_report": {k: report[k] for k in ("changed", "kept") if k in report},
        "torch_threads": torch.get_num_threads(),
        **device_publish,
    }, indent=1))


def publish_from_device(a: argparse.Namespace, pub: "weightcast.Publisher", trainer: dict,
                        dev: "torch.device", sync, step: int) -> dict:
    """The trainer side on a GPU: a delta published from device memory,
    against a pinned device-to-host copy of the model (the floor the issue
    sets: at most 2x) and a comparison of two versions on the device. Both
    ways: through host memory (``diff_on_device=False``: copy everything to
    pinned memory, diff on the host) and from changes found on the device
    (the default where the device has room for the copy)."""
    on_dev = {k: v.to(dev) for k, v in trainer.items()}
    pinned = {k: torch.empty_like(v, pin_memory=torch.cuda.is_available())
              for k, v in trainer.items()}
    d2h, compare = [], []
    publish = {"host": [], "device": []}
    diff = {"host": [], "device": []}
    phases = []

    def version(mode: str) -> None:
        nonlocal step
        sync()
        t = time.perf_counter()
        for k, v in on_dev.items():
            pinned[k].copy_(v, non_blocking=True)
        sync()
        d2h.append(time.perf_counter() - t)
        before = {k: v.clone() for k, v in on_dev.items()}
        for v in on_dev.values():  # a training step on the device
            flat = v.view(-1)
            idx = torch.randint(0, flat.numel(), (int(flat.numel() * a.density),), device=dev)
            flat[idx] = flat[idx] * (1 + 2.0**-6) + 1e-4
        sync()
        t = time.perf_counter()
        n = sum(int((before[k].view(torch.int16) != v.view(torch.int16)).sum())
                for k, v in on_dev.items())
        sync()
        compare.append(time.perf_counter() - t)
        del before
        t = time.perf_counter()
        out = pub.publish(on_dev, step=step)
        took = time.perf_counter() - t
        step += 1
        assert out["kind"] == "delta" and out["changed"] == n, (out, n)
        if mode:
            ph = pub.last_phases
            assert ph["path"] == mode, (mode, ph)
            publish[mode].append(took)
            phases.append({"path": mode, **{k: round(v, 4) for k, v in ph.items()
                                            if isinstance(v, float)}})
            # the diff: from the tensors on the device to the delta's bytes
            diff[mode].append(ph["device_diff_s"] + ph["to_host_s"] + ph["encode_s"]
                              if mode == "device" else ph["to_host_s"] + ph["diff_s"])

    pub.diff_on_device = False
    for _ in range(a.repeats):
        version("host")
    pub.diff_on_device = None
    version("")  # takes the device copy (through host memory)
    for _ in range(a.repeats):
        version("device" if dev.type == "cuda" else "host")
    c = statistics.median(d2h)
    out = {
        "publish_from_device_s": [round(x, 4) for x in publish["device"]],
        "publish_from_device_host_path_s": [round(x, 4) for x in publish["host"]],
        "publish_from_device_phases": phases,
        "pinned_d2h_s": [round(x, 4) for x in d2h],
        "device_compare_s": [round(x, 4) for x in compare],
        "publish_host_path_over_d2h": round(statistics.median(publish["host"]) / c, 2),
        "diff_host_path_s": [round(x, 4) for x in diff["host"]],
        "diff_host_path_over_d2h": round(statistics.median(diff["host"]) / c, 2),
    }
    if publish["device"]:
        out["publish_from_device_over_d2h"] = round(statistics.median(publish["device"]) / c, 2)
        out["diff_from_device_s"] = [round(x, 4) for x in diff["device"]]
        out["diff_from_device_over_d2h"] = round(statistics.median(diff["device"]) / c, 2)
    return out


if __name__ == "__main__":
    main()
