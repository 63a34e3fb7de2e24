"""Where the device path's commit goes (a probe, not a benchmark)."""
import tempfile, time, json
import torch
import weightcast
from weightcast import _device

dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
sync = (lambda: torch.cuda.synchronize()) if dev.type == "cuda" else (lambda: None)
side, n, dens = 4096, 16, 0.014
per = int(side * side * dens)
out = {}

def best(f, reps=5):
    for _ in range(2):
        f(); sync()
    r = []
    for _ in range(reps):
        sync(); t = time.perf_counter(); f(); sync(); r.append(time.perf_counter() - t)
    return round(min(r) * 1e3, 3)

words = {f"l{i}": torch.randn(side * side, device=dev).bfloat16().view(torch.int16) for i in range(n)}
idx = {k: torch.randperm(side * side, device=dev)[:per].sort().values for k in words}
sep = {k: torch.randint(-30000, 30000, (per,), device=dev, dtype=torch.int16) for k in words}
big = torch.empty(n * ((per * 2 + 7) // 8 * 8), dtype=torch.uint8, device=dev)
view, off = {}, 0
for k in words:
    view[k] = big[off:off + per * 2].view(torch.int16); off += (per * 2 + 7) // 8 * 8
out["index_copy_separate_ms"] = best(lambda: [words[k].index_copy_(0, idx[k], sep[k]) for k in words])
out["index_copy_view_ms"] = best(lambda: [words[k].index_copy_(0, idx[k], view[k]) for k in words])
out["index_put_ms"] = best(lambda: [words[k].__setitem__(idx[k], sep[k]) for k in words])
out["scatter_ms"] = best(lambda: [words[k].scatter_(0, idx[k], sep[k]) for k in words])

# the real pipeline
d = tempfile.mkdtemp()
g = torch.Generator().manual_seed(0)
trainer = {f"l{i}": (torch.randn(side, side, generator=g) * 0.02).bfloat16() for i in range(n)}
pub = weightcast.Publisher(f"file://{d}/b", state_dir=f"{d}/s", anchor_encoding="raw", anchor_every=10**6)
pub.publish(trainer, step=0)
sub = weightcast.Subscriber(f"file://{d}/b")
engine = {k: torch.empty_like(v, device=dev) for k, v in trainer.items()}
sub.poll().apply_to(engine)
rows = []
for step in range(1, 5):
    for w in trainer.values():
        i = torch.randint(0, side * side, (per,), generator=g)
        f = w.view(-1); f[i] = f[i] * (1 + 2.0**-6) + 1e-4
    pub.publish(trainer, step=step)
    u = sub.poll()
    u.prepare(engine, via="scatter")
    sync()
    params, via, (writes, plan), ready = u._prepared
    t = time.perf_counter(); _device.write(writes); sync(); w_ms = (time.perf_counter() - t) * 1e3
    t = time.perf_counter(); u._native.commit_resolved(); c_ms = (time.perf_counter() - t) * 1e3
    u._prepared = None
    rows.append({"write_ms": round(w_ms, 3), "commit_resolved_ms": round(c_ms, 3),
                 "idx_dtype": str(writes[0][1].dtype), "idx_contig": writes[0][1].is_contiguous(),
                 "vals_offset": writes[1][2].storage_offset(), "phases": dict(_device.last)})
    # the same writes again, per-tensor synced (the floor's way)
    tot = 0
    for wd, ix, vals in writes:
        sync(); t = time.perf_counter(); wd.index_copy_(0, ix, vals); sync(); tot += time.perf_counter() - t
    rows[-1]["rewrite_synced_ms"] = round(tot * 1e3, 3)
    rows[-1]["rewrite_best_ms"] = best(lambda: _device.write(writes))
out["pipeline"] = rows
print(json.dumps(out, indent=1))
