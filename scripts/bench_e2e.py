#!/usr/bin/env python3
"""End-to-end scaling benchmark (issue 15): publish and catch-up against model size.

For each model size it writes a bf16 model as a sharded Hugging Face
checkpoint (random N(0, 0.02) weights, `--shards` files of tensors of at most
64 Mi elements), then steps it the way an RL step changes bf16 weights: a
`--density` fraction of the elements, at random positions, moves by one ulp
(the lowest bit of the bf16 word flips), rewriting the files in place. It
drives the real `weightcast` binary:

- the `publisher` daemon, sent one `POST /v1/publish` per version as a
  trainer loop sends it: the anchor (v0), then each delta, timed, with the
  daemon's peak RSS and peak RssAnon (anonymous memory, not the page cache)
  during the request, sampled from /proc every 2 ms;
- a `subscribe` daemon A notified after every version (one behind: its own
  `last_apply_seconds`, and the wall time from the end of the POST until its
  `/v1/status` shows the version), a daemon B stopped after its bootstrap
  and restarted after the last delta (`--versions` behind: its
  `last_apply_seconds` for the catch-up, after its start-up check of its
  current slot), and a fresh `subscribe --once` after the first delta
  (anchor + delta), each with its peak RssAnon;
- the baselines in the same run, on the same files: reading the checkpoint
  once from the page cache (`cat`), a plain copy of it (`cp`), and a plain
  compare of the two steps' files (numpy `!=` over memory maps).

Two stores: a `file://` bucket, and (with `--s3`) moto's S3 server in its own
network namespace behind a veth link shaped to `--link-mbps` MB/s with `tc
tbf` in both directions (needs root and iproute2). On S3 it also times the
full-model sync baseline over the same link: boto3 uploading every file of
the checkpoint and downloading it again (multipart, 8 threads).

    python3 scripts/bench_e2e.py --sizes 1e8,5e8,1e9,3e9 --s3 \\
        --work /tmp/wc-e2e --json docs/bench/e2e.json --plot docs/bench/e2e.png

`--state-mode` passes the publisher's mode; `--step-dirs` writes each
version to a directory of its own (the last two kept, as a trainer with
`save_total_limit=2`), which `--state-mode previous` needs, and records the
trainer's copy time apart. Each delta's JSON has the publisher's own writes
(`publisher_write_bytes`, from `/proc/self/io`).

Needs `cargo build --release` (the binary at target/release/weightcast),
numpy, and for `--s3` root and a Python with moto and boto3 to run this
script (`.ci-work/venv/bin/python`, which `./scripts/test.sh` sets up). Disk under `--work`: about 4x the
largest model (checkpoint, its previous copy, the publisher's snapshot, the
bucket), plus the subscribers' slots under `--out-root` (two slots each);
`--lean` runs only the publisher and daemon A (no previous copy, no B, no
fresh `--once`), about 3.7x the model in all, for sizes the disk cannot
otherwise hold.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))  # netlab
KEY = "bench-e2e-notify-secret"
MAX_TENSOR = 64 << 20  # elements


# ---------------------------------------------------------------- the model


def tensor_plan(elements: int, shards: int) -> list[list[tuple[str, int]]]:
    """Tensors (name, elements) per shard: equal shards, tensors of at most MAX_TENSOR."""
    per = -(-elements // shards)
    plan, k = [], 0
    for s in range(shards):
        left = min(per, elements - s * per)
        ts = []
        while left > 0:
            n = min(left, MAX_TENSOR)
            ts.append((f"model.layers.{k}.weight", n))
            k += 1
            left -= n
        plan.append(ts)
    return plan


def shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05}-of-{n:05}.safetensors"


def write_model(d: Path, elements: int, shards: int, seed: int, fast: bool = False) -> None:
    """Writes step 0: safetensors files (BF16), the index and config.json.
    ``fast`` (3x faster, for the largest sizes): one block of N(0, 0.02)
    words drawn once, each later block that block with its sign and mantissa
    bits xored with random bits. The exponents, which the compressed anchor
    models, keep the normal's distribution; sign and mantissa stay uniform."""
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    base = None
    plan = tensor_plan(elements, shards)
    weight_map = {}
    for i, ts in enumerate(plan):
        header, off = {}, 0
        for name, n in ts:
            header[name] = {"dtype": "BF16", "shape": [n], "data_offsets": [off, off + 2 * n]}
            off += 2 * n
            weight_map[name] = shard_name(i, shards)
        header["__metadata__"] = {"format": "pt"}
        h = json.dumps(header, separators=(",", ":")).encode()
        h += b" " * (-len(h) % 8)
        with open(d / shard_name(i, shards), "wb") as f:
            f.write(len(h).to_bytes(8, "little") + h)
            for _, n in ts:
                done = 0
                while done < n:
                    c = min(n - done, 16 << 20)
                    if fast and base is not None:
                        noise = np.frombuffer(rng.bytes(2 * c), np.uint16) & np.uint16(0x807F)
                        f.write((base[:c] ^ noise).tobytes())
                    else:
                        x = (rng.standard_normal(c, dtype=np.float32) * 0.02).view(np.uint32)
                        words = (x >> 16).astype(np.uint16)
                        if fast and c == 16 << 20:
                            base = words
                        f.write(words.tobytes())
                    done += c
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 2 * elements}, "weight_map": weight_map})
    )
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "step": 0}))


def data_map(path: Path, mode: str = "r") -> np.memmap:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
    return np.memmap(path, dtype=np.uint16, mode=mode, offset=8 + n)


def step_model(d: Path, density: float, rng: np.random.Generator, step: int,
               fast: bool = False) -> int:
    """One step in place: flips the lowest bit of ~density of the words.
    ``fast`` (40x faster at picking them): each word independently with
    probability ``density`` (geometric gaps), instead of ``density`` x size
    draws with the repeats removed (a sort)."""
    changed = 0
    for p in sorted(d.glob("model-*.safetensors")):
        a = data_map(p, "r+")
        k = int(a.size * density)
        if fast:
            idx = np.cumsum(rng.geometric(density, size=k + k // 8 + 64)) - 1
            idx = idx[idx < a.size]
        else:
            idx = np.unique(rng.integers(0, a.size, k))
        a[idx] ^= 1
        a.flush()
        changed += idx.size
        del a
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "step": step}))
    return changed


def plain_compare(a: Path, b: Path) -> int:
    """Differing words of two checkpoints, by numpy over memory maps."""
    diff = 0
    for p in sorted(a.glob("model-*.safetensors")):
        x, y = data_map(p), data_map(b / p.name)
        for o in range(0, x.size, 64 << 20):
            diff += int(np.count_nonzero(x[o : o + (64 << 20)] != y[o : o + (64 << 20)]))
    return diff


def timed(f, *a) -> tuple[float, object]:
    t = time.perf_counter()
    r = f(*a)
    return time.perf_counter() - t, r


def cat_seconds(d: Path) -> float:
    """Reading the checkpoint once from the page cache: best of two after a warm-up."""
    files = [str(p) for p in sorted(d.glob("model-*.safetensors"))]
    run = lambda: subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)
    run()
    return min(timed(run)[0] for _ in range(2))


# ------------------------------------------------------------- processes


def mem_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, RssAnon) of a process in KiB (0, 0 once it is gone)."""
    rss = anon = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1])
                elif line.startswith("RssAnon:"):
                    anon = int(line.split()[1])
    except OSError:
        pass
    return rss, anon


class Sampler:
    """Peak RSS and RssAnon of a process, sampled every 2 ms until stopped."""

    def __init__(self, pid: int):
        self.pid, self.rss, self.anon = pid, 0, 0
        self.stop_ = threading.Event()
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def run(self):
        while not self.stop_.is_set():
            r, a = mem_kib(self.pid)
            self.rss, self.anon = max(self.rss, r), max(self.anon, a)
            time.sleep(0.002)

    def take(self) -> tuple[float, float]:
        """(peak RSS, peak RssAnon) in MiB since the last take."""
        r = (self.rss / 1024, self.anon / 1024)
        self.rss = self.anon = 0
        return r

    def stop(self):
        self.stop_.set()
        self.t.join()


def run_measured(cmd: list[str], env: dict) -> dict:
    """Runs a command to its end: seconds, peak RSS / RssAnon (MiB), its stdout."""
    t = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    s = Sampler(p.pid)
    out, err = p.communicate()
    secs = time.perf_counter() - t
    s.stop()
    if p.returncode != 0:
        sys.exit(f"`{' '.join(cmd)}` failed ({p.returncode}):\n{err}")
    rss, anon = s.take()
    return {"seconds": secs, "peak_rss_mib": rss, "peak_rss_anon_mib": anon, "stdout": out,
            "stderr": err}


class Proc:
    """A daemon this script started, with its memory sampled."""

    p: subprocess.Popen
    sampler: Sampler

    def start(self, cmd: list[str], env: dict, log: Path) -> None:
        with open(log, "w") as f:
            self.p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=f)
        self.sampler = Sampler(self.p.pid)

    def stop(self):
        self.sampler.stop()
        self.p.send_signal(signal.SIGTERM)
        try:
            self.p.wait(30)
        except subprocess.TimeoutExpired:
            self.p.kill()


class Daemon(Proc):
    """A `weightcast subscribe` daemon on an output directory."""

    def __init__(self, bin_: str, store: str, out: Path, port: int, env: dict, log: Path,
                 fresh: bool = True):
        self.out, self.base = out, f"http://127.0.0.1:{port}"
        if fresh:
            shutil.rmtree(out, ignore_errors=True)
        self.start([bin_, "subscribe", "-q", "--store", store, "--out", str(out),
                    "--listen", f"127.0.0.1:{port}", "--notify-key", KEY, "--poll-interval", "3600"],
                   env, log)

    def status(self) -> dict:
        req = urllib.request.Request(self.base + "/v1/status", headers={"Authorization": f"Bearer {KEY}"})
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                return json.load(r)["status"]
        except (OSError, ValueError, KeyError):
            return {}

    def wait_version(self, v: int, limit: float = 1800) -> tuple[float, dict]:
        t = time.perf_counter()
        while True:
            s = self.status()
            if s.get("version") == v:
                return time.perf_counter() - t, s
            if self.p.poll() is not None or time.perf_counter() - t > limit:
                sys.exit(f"subscriber {self.out} did not reach v{v}: {s}")
            time.sleep(0.005)

    def wait_standby(self, v: int, limit: float = 1800) -> float:
        """Waits until every slot holds v, clean (the daemon's idle work is done)."""
        t = time.perf_counter()
        while time.perf_counter() - t < limit:
            try:
                st = json.loads((self.out / ".state.json").read_text())
                if all(x.get("version") == v and not x.get("dirty") for x in st["slots"].values()):
                    return time.perf_counter() - t
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.01)
        sys.exit(f"subscriber {self.out}: the standby slot did not reach v{v}")



class PublisherDaemon(Proc):
    """`weightcast publisher`: each version is a POST, as a trainer loop sends it."""

    TOKEN = "bench-e2e-publisher-token"

    def __init__(self, bin_: str, store: str, state: Path, root: Path, notify: list[str],
                 env: dict, log: Path, state_mode: str = "auto"):
        port = free_port()
        self.url = f"http://127.0.0.1:{port}/v1/publish"
        cmd = [bin_, "publisher", "--store", store, "--state", str(state), "--token", self.TOKEN,
               "--checkpoint-root", str(root), "--listen", f"127.0.0.1:{port}",
               "--anchor-every", "1000", "--notify-key", KEY, "--state-mode", state_mode]
        for u in notify:
            cmd += ["--notify", u]
        self.start(cmd, env, log)
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1)
                return
            except OSError:
                if self.p.poll() is not None:
                    sys.exit(f"the publisher daemon exited: {log.read_text()}")
                time.sleep(0.05)
        sys.exit("the publisher daemon did not start")

    def publish(self, ckpt: Path, step: int) -> dict:
        body = json.dumps({"checkpoint": str(ckpt), "step": step}).encode()
        req = urllib.request.Request(self.url, data=body, method="POST", headers={
            "Authorization": f"Bearer {self.TOKEN}", "Content-Type": "application/json"})
        self.sampler.take()
        t = time.perf_counter()
        with urllib.request.urlopen(req, timeout=3600) as r:
            report = json.load(r)
        secs = time.perf_counter() - t
        rss, anon = self.sampler.take()
        return {"seconds": secs, "peak_rss_mib": rss, "peak_rss_anon_mib": anon, "report": report}



def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, what: str) -> None:
    """Waits (30 s at most) until `url` answers while `proc` runs."""
    for _ in range(300):
        try:
            urllib.request.urlopen(url, timeout=1)
            return
        except OSError:
            if proc.poll() is not None:
                sys.exit(f"{what} exited ({proc.returncode})")
            time.sleep(0.1)
    sys.exit(f"{what} did not start")


# ------------------------------------------------------ S3 behind a link


class ShapedS3:
    """moto in its own network namespace, reached from this host over a veth
    pair shaped with tbf (`scripts/netlab.py`)."""

    def __init__(self, mbps: float):
        from netlab import HOST, Lab

        self.lab = Lab(prefix="wce2e", net=231)
        ns = self.lab.namespace("s3")
        self.link = self.lab.link(HOST, ns, rate_mbit=mbps * 8)
        self.url = f"http://{self.link.addr_b}:9000"
        # netlab's moto serves ranged GETs from the object's spool (stock
        # moto reads the whole object for each one).
        moto = self.lab.tool(ns, ["--max-seconds", "14400", "moto", self.link.addr_b, "9000"])
        wait_http(self.url, moto, "moto in the namespace")

    def env(self, base: dict) -> dict:
        e = dict(base)
        e.update(AWS_ENDPOINT=self.url, AWS_ALLOW_HTTP="true", AWS_ACCESS_KEY_ID="test",
                 AWS_SECRET_ACCESS_KEY="test", AWS_REGION="us-east-1")
        return e

    def bucket(self, name: str) -> None:
        urllib.request.urlopen(urllib.request.Request(f"{self.url}/{name}", method="PUT"), timeout=30)

    def link_bytes(self) -> int:
        return self.link.counters().total

    def full_sync(self, d: Path, bucket: str, scratch: Path) -> dict:
        """The baseline: boto3 uploads every checkpoint file, then downloads them."""
        import boto3
        from boto3.s3.transfer import TransferConfig

        s3 = boto3.client("s3", endpoint_url=self.url, aws_access_key_id="test",
                          aws_secret_access_key="test", region_name="us-east-1")
        cfg = TransferConfig(multipart_chunksize=16 << 20, max_concurrency=8)
        files = sorted(p for p in d.iterdir() if p.is_file())
        t = time.perf_counter()
        for p in files:
            s3.upload_file(str(p), bucket, f"full/{p.name}", Config=cfg)
        up = time.perf_counter() - t
        scratch.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        for p in files:
            s3.download_file(bucket, f"full/{p.name}", str(scratch / p.name), Config=cfg)
        down = time.perf_counter() - t
        shutil.rmtree(scratch)
        for p in files:
            s3.delete_object(Bucket=bucket, Key=f"full/{p.name}")
        size = sum(p.stat().st_size for p in files)
        return {"upload_s": up, "download_s": down, "bytes": size,
                "upload_mb_s": size / up / 1e6, "download_mb_s": size / down / 1e6}

    def cleanup(self):
        self.lab.close()


# ------------------------------------------------------------ one run


def run_size(a, elements: int, store_kind: str, s3: ShapedS3 | None) -> dict:
    bin_ = str(ROOT / "target/release/weightcast")
    work = Path(a.work) / f"{store_kind}-{elements:.0e}"
    out_root = Path(a.out_root) / f"{store_kind}-{elements:.0e}"
    for p in (work, out_root):
        shutil.rmtree(p, ignore_errors=True)
        p.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WEIGHTCAST_", "AWS_"))}
    env["RUST_LOG"] = "weightcast=warn"
    if store_kind == "file":
        bucket_dir = Path(a.bucket_root) / f"{store_kind}-{elements:.0e}-bucket" if a.bucket_root else work / "bucket"
        shutil.rmtree(bucket_dir, ignore_errors=True)
        bucket_dir.mkdir(parents=True)
        store = bucket_dir.as_uri()
    else:
        bucket = f"e2e{elements:.0e}".replace("+", "")
        s3.bucket(bucket)
        store = f"s3://{bucket}/run"
        env = s3.env(env)
    ckpt, prev = work / ("step-0" if a.step_dirs else "ckpt"), work / "prev"
    rng = np.random.default_rng(a.seed)
    print(f"[{store_kind} {elements:.0e}] writing the model", file=sys.stderr)
    write_model(ckpt, elements, a.shards, a.seed, fast=a.fast_gen)
    size = sum(p.stat().st_size for p in ckpt.glob("model-*.safetensors"))
    row: dict = {"store": store_kind, "elements": elements, "model_bytes": size,
                 "fast_gen": a.fast_gen, "state_mode": a.state_mode, "step_dirs": a.step_dirs}
    link0 = s3.link_bytes() if s3 else 0

    row["read_once_s"] = cat_seconds(ckpt)
    port_a = free_port()
    state = Path(a.state_root) / f"{store_kind}-{elements:.0e}-state"
    shutil.rmtree(state, ignore_errors=True)
    pub = PublisherDaemon(bin_, store, state, work,
                          [f"http://127.0.0.1:{port_a}/v1/notify"], env, work / "publisher.log",
                          a.state_mode)

    def publish(v: int) -> dict:
        l0 = s3.link_bytes() if s3 else 0
        r = pub.publish(ckpt, v + 1)
        if s3:
            r["link_bytes"] = s3.link_bytes() - l0
        return r

    row["publish_anchor"] = publish(0)
    print(f"[{store_kind} {elements:.0e}] anchor published in {row['publish_anchor']['seconds']:.2f} s", file=sys.stderr)
    # Two subscribers bootstrap from it: A is notified of every version, B
    # goes down until the last one.
    da = Daemon(bin_, store, out_root / "a", port_a, env, work / "a.log")
    db = None if a.lean else Daemon(bin_, store, out_root / "b", free_port(), env, work / "b.log")
    for name, d in (("bootstrap_daemon_a", da), ("bootstrap_daemon_b", db)):
        if d is None:
            continue
        secs, st = d.wait_version(0)
        d.wait_standby(0)
        row[name] = {"seconds": secs, "peak_rss_anon_mib": d.sampler.take()[1]}
    # B is down (as a preempted node) until the last version: it restarts
    # that many versions behind.
    if db:
        db.stop()
    deltas = []
    for v in range(1, a.versions + 1):
        first = v == 1
        if first and not a.lean:
            row["plain_copy_s"], _ = timed(shutil.copytree, ckpt, prev)
        trainer_write = None
        if a.step_dirs:
            # The trainer writes each step to a directory of its own and keeps
            # the last two (save_total_limit=2): a full write of the model.
            new = work / f"step-{v}"
            if v >= 2:
                shutil.rmtree(work / f"step-{v - 2}")
            trainer_write, _ = timed(shutil.copytree, ckpt, new)
            ckpt = new
        changed = step_model(ckpt, a.density, rng, v, fast=a.fast_gen)
        if first and not a.lean:
            row["plain_compare_s"], diff = timed(plain_compare, prev, ckpt)
            assert diff == changed, (diff, changed)
            shutil.rmtree(prev)
        # The baseline next to each measurement (the machine's load drifts).
        read_once = cat_seconds(ckpt)
        da.sampler.take()
        last = v == a.versions
        p = publish(v)
        wall, st = da.wait_version(v)
        apply_s = st.get("last_apply_seconds")
        anon_a = da.sampler.take()[1]
        standby = da.wait_standby(v)
        d = {"version": v, "changed": changed, "read_once_s": read_once, "publish": p,
             "publish_over_read": p["seconds"] / read_once,
             "catch_up_1_over_read": apply_s / read_once, "catch_up_1_s": apply_s,
             "catch_up_1_wall_after_publish_s": wall, "catch_up_1_peak_rss_anon_mib": anon_a,
             "standby_s": standby, "delta_bytes": p["report"]["bytes"],
             "publisher_write_bytes": p["report"].get("local_write_bytes"),
             "trainer_write_s": trainer_write}
        if first and not a.lean:
            # A fresh subscriber: the anchor and this delta.
            fresh = run_measured([bin_, "subscribe", "-q", "--once", "--store", store,
                                  "--out", str(out_root / "c")], env)
            d["fresh_bootstrap"] = {k: fresh[k] for k in ("seconds", "peak_rss_mib", "peak_rss_anon_mib")}
            shutil.rmtree(out_root / "c")
        if last and not a.lean:
            db = Daemon(bin_, store, out_root / "b", free_port(), env, work / "b2.log", fresh=False)
            secs, st = db.wait_version(v)
            d["catch_up_10"] = {"behind": v, "seconds": st.get("last_apply_seconds"),
                                "wall_after_publish_s": secs,
                                "peak_rss_anon_mib": db.sampler.take()[1]}
        deltas.append(d)
        print(f"[{store_kind} {elements:.0e}] v{v}: read once {read_once:.3f} s, publish "
              f"{p['seconds']:.2f} s, catch-up {apply_s:.3f} s, delta {d['delta_bytes'] / 1e6:.1f} MB",
              file=sys.stderr)
    da.stop()
    if db:
        db.stop()
    pub.stop()
    row["deltas"] = deltas
    if s3:
        row["link_bytes"] = s3.link_bytes() - link0
        row["full_sync"] = s3.full_sync(ckpt, bucket, work / "full")
    shutil.rmtree(work)
    shutil.rmtree(out_root, ignore_errors=True)
    shutil.rmtree(state, ignore_errors=True)
    if store_kind == "file" and a.bucket_root:
        shutil.rmtree(bucket_dir, ignore_errors=True)
    return row


def summarize(row: dict) -> dict:
    """The figures the goals are about."""
    d1 = row["deltas"][0]
    med = lambda xs: float(np.median(xs))
    pub = med([d["publish"]["seconds"] for d in row["deltas"]])
    cu = med([d["catch_up_1_s"] for d in row["deltas"]])
    lean = "fresh_bootstrap" not in d1
    s = {
        "store": row["store"], "elements": row["elements"], "model_gb": row["model_bytes"] / 1e9,
        "read_once_s": med([d["read_once_s"] for d in row["deltas"]]),
        "plain_copy_s": row.get("plain_copy_s"), "plain_compare_s": row.get("plain_compare_s"),
        "publish_anchor_s": row["publish_anchor"]["seconds"],
        "publish_delta_s": pub, "catch_up_1_s": cu,
        # Medians of the per-version ratios to the read-once next to each.
        "publish_delta_over_read": med([d["publish_over_read"] for d in row["deltas"]]),
        "catch_up_1_over_read": med([d["catch_up_1_over_read"] for d in row["deltas"]]),
        "catch_up_10_s": None if lean else row["deltas"][-1]["catch_up_10"]["seconds"],
        "fresh_bootstrap_s": None if lean else d1["fresh_bootstrap"]["seconds"],
        "delta_mb": med([d["delta_bytes"] for d in row["deltas"]]) / 1e6,
        "state_mode": row.get("state_mode", "auto"),
        # The publisher's own writes to storage per delta version
        # (/proc/self/io write_bytes), and their ratio to the delta.
        "publisher_write_mb": (med([d["publisher_write_bytes"] for d in row["deltas"]]) / 1e6
                               if all(d.get("publisher_write_bytes") is not None for d in row["deltas"])
                               else None),
        "anchor_mb": row["publish_anchor"]["report"]["bytes"] / 1e6,
        "peak_rss_anon_mib": {
            "publish_anchor": row["publish_anchor"]["peak_rss_anon_mib"],
            "publish_delta": max(d["publish"]["peak_rss_anon_mib"] for d in row["deltas"]),
            "subscriber_bootstrap": max(row[k]["peak_rss_anon_mib"] for k in
                                        ("bootstrap_daemon_a", "bootstrap_daemon_b") if k in row),
            "subscriber_catch_up_1": max(d["catch_up_1_peak_rss_anon_mib"] for d in row["deltas"]),
            "subscriber_catch_up_10": None if lean else row["deltas"][-1]["catch_up_10"]["peak_rss_anon_mib"],
            "fresh_once": None if lean else d1["fresh_bootstrap"]["peak_rss_anon_mib"],
        },
        "peak_rss_mib_publish_anchor": row["publish_anchor"]["peak_rss_mib"],
    }
    if "full_sync" in row:
        f = row["full_sync"]
        full = f["upload_s"] + f["download_s"]
        s.update(full_sync_s=full, full_upload_mb_s=f["upload_mb_s"],
                 full_download_mb_s=f["download_mb_s"],
                 anchor_mb_s=row["publish_anchor"]["report"]["bytes"] / row["publish_anchor"]["seconds"] / 1e6,
                 e2e_delta_s=pub + cu, e2e_speedup=full / (pub + cu))
    return s


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    link = any(r["store"] == "s3" for r in rows)
    fig, ax = plt.subplots(1, 3 if link else 2, figsize=(15 if link else 10, 4.5))
    for kind, mark in (("file", "o-"), ("s3", "s--")):
        rs = [r for r in rows if r["store"] == kind]
        if not rs:
            continue
        x = [r["elements"] / 1e9 for r in rs]
        ax[0].plot(x, [r["publish_delta_s"] for r in rs], mark, label=f"publish delta ({kind})")
        ax[0].plot(x, [r["catch_up_1_s"] for r in rs], mark, label=f"catch-up 1 behind ({kind})")
        if kind == "file":
            ax[0].plot(x, [r["read_once_s"] for r in rs], "k:", label="read once (cat)")
            xc = [(xi, r["plain_compare_s"]) for xi, r in zip(x, rs) if r.get("plain_compare_s")]
            if xc:
                ax[0].plot(*zip(*xc), "k-.", label="plain compare")
        for k in rs[-1]["peak_rss_anon_mib"]:
            xk = [(xi, r["peak_rss_anon_mib"].get(k)) for xi, r in zip(x, rs)]
            xk = [p for p in xk if p[1] is not None]
            if xk:
                ax[1].plot(*zip(*xk), mark, label=f"{k} ({kind})")
        if kind == "s3":
            ax[2].plot(x, [r["full_sync_s"] for r in rs], "k^:", label="full sync (boto3 up + down)")
            ax[2].plot(x, [r["e2e_delta_s"] for r in rs], mark, label="publish + catch-up (delta)")
            ax[2].plot(x, [r["publish_anchor_s"] for r in rs], mark, label="publish anchor")
    ax[0].set(xlabel="model (billion bf16 elements)", ylabel="seconds", title="time against size")
    ax[1].set(xlabel="model (billion bf16 elements)", ylabel="MiB", title="peak RssAnon")
    if link:
        ax[2].set(xlabel="model (billion bf16 elements)", ylabel="seconds", yscale="log",
                  title="over the shaped link: delta vs full sync")
    for x in ax:
        x.legend(fontsize=7)
        x.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1e8,5e8,1e9,3e9", help="model sizes in elements, comma separated")
    ap.add_argument("--s3", action="store_true", help="also on moto behind a shaped link (root)")
    ap.add_argument("--s3-sizes", default=None, help="sizes for S3 (default: --sizes)")
    ap.add_argument("--link-mbps", type=float, default=100.0, help="link rate, MB/s")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--density", type=float, default=0.015)
    ap.add_argument("--lean", action="store_true",
                    help="only the publisher and daemon A (no B, no fresh --once, no copy/compare "
                         "baseline): the disk the largest sizes need is about 3.7x the model "
                         "(checkpoint, snapshot, bucket, A's two slots) instead of 10x")
    ap.add_argument("--versions", type=int, default=10, help="deltas per size (B catches up all of them)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--state-mode", default="auto",
                    help="the publisher's --state-mode (auto, in-place, overlay, previous)")
    ap.add_argument("--step-dirs", action="store_true",
                    help="each version in a directory of its own, the last two kept (as a "
                         "trainer with save_total_limit=2), instead of stepping one in place; "
                         "needed by --state-mode previous")
    ap.add_argument("--fast-gen", action="store_true",
                    help="the faster model and steps (see write_model, step_model): for the "
                         "largest sizes, where drawing the model dominates the run")
    ap.add_argument("--work", default="/tmp/wc-e2e", help="checkpoint, state and file bucket")
    ap.add_argument("--out-root", default=None, help="subscriber outputs (default: --work)")
    ap.add_argument("--state-root", default=None,
                    help="the publisher's snapshot (default: --work; on tmpfs it costs no disk writes)")
    ap.add_argument("--bucket-root", default=None,
                    help="the file:// bucket (default: --work); tmpfs here keeps the largest sizes "
                         "within a small disk")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    ap.add_argument("--from-json", nargs="+", metavar="FILE",
                    help="plot (--plot) and print the summaries of earlier runs' JSON files instead of running")
    a = ap.parse_args()
    if a.from_json:
        summary = [s for f in a.from_json for s in json.loads(Path(f).read_text())["summary"]]
        summary.sort(key=lambda s: (s["store"], s["elements"]))
        for s in summary:
            print(json.dumps(s))
        if a.plot:
            plot(summary, a.plot)
        return
    a.out_root = a.out_root or a.work
    a.state_root = a.state_root or a.work
    if not (ROOT / "target/release/weightcast").exists():
        sys.exit("build the binary first: cargo build --release")
    sizes = [int(float(x)) for x in a.sizes.split(",")]
    s3_sizes = [int(float(x)) for x in (a.s3_sizes or a.sizes).split(",")] if a.s3 else []
    rows, s3 = [], None
    try:
        for n in sizes:
            rows.append(run_size(a, n, "file", None))
            print(json.dumps(summarize(rows[-1])), flush=True)
        if s3_sizes:
            s3 = ShapedS3(a.link_mbps)
            for n in s3_sizes:
                rows.append(run_size(a, n, "s3", s3))
                print(json.dumps(summarize(rows[-1])), flush=True)
    finally:
        if s3:
            s3.cleanup()
    summary = [summarize(r) for r in rows]
    if a.json:
        Path(a.json).write_text(json.dumps({"summary": summary, "runs": rows}, indent=1))
    if a.plot:
        plot(summary, a.plot)


if __name__ == "__main__":
    main()
