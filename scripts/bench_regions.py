#!/usr/bin/env python3
"""Emulated multi-region fleet: time-to-fleet and bytes per inter-region link.

One command builds the topology with network namespaces (scripts/netlab.py),
runs the scenario twice on the same model and versions — `delta`
(weightcast's defaults: an anchor, then deltas) and `full` (the full-model
baseline: `--anchor-every 1 --anchor-encoding raw`, every version the whole
model through the same relays) — and prints and saves the figures.

    origin namespace                          region r namespace (r = 0..R-1)
    ┌───────────────────────────┐  veth, tbf  ┌──────────────────────────────────┐
    │ moto :5000, bucket origin │◄───────────►│ relay --from s3://origin/policy  │
    │ weightcast publish        │ --link-mbps │       --to s3://region<r>/policy │
    │   --notify <each relay>   │  each way   │ moto :5000, bucket region<r>     │
    └───────────────────────────┘             │ S × weightcast subscribe          │
                                              └──────────────────────────────────┘

Per version: the publish time (the `weightcast publish` process), the
time-to-fleet (from the publish starting until the last subscriber of every
region reports the version on `GET /v1/status`, polled every 50 ms inside each
region), when each region's relay reported the version, and the bytes that
crossed each link (both directions, from the veth counters). Before the
scenario it measures the raw link: a GET of a `--link-test-mb` object from
the origin's moto through one link, through all links at once, and on the
origin's loopback (moto's own speed, no link).

The checkpoint comes from `crates/core/examples/bench_model.rs` (a Hugging Face sharded
directory rewritten in place per step). Everything is verified at the end of
each mode: every subscriber holds the last version, its tensors are
bit-identical to the trainer's checkpoint (BLAKE2b of every tensor's bytes,
the other files byte for byte), and each delta version crossed each link at
most once (link bytes < 3 × the version's object bytes + 1 MiB). With
`--small` (the CI preset: a ~18M-element model, 2 regions × 2 subscribers, an
anchor and 2 deltas, well under 2 minutes) a failed check exits non-zero;
`--check` does the same for any size.

Needs root, iproute2 (`ip netns`, veth) and `tc` (tbf), curl, the moto
server package (run this with the Python that has moto: the repository's test
venv, `.ci-work/venv/bin/python`), numpy is not needed; matplotlib only for
`--plot`. Build first:

    cargo build --release --bin weightcast && cargo build --release -p weightcast-core --example bench_model
    sudo .ci-work/venv/bin/python scripts/bench_regions.py --small
    sudo .ci-work/venv/bin/python scripts/bench_regions.py --elements 1e9 \\
        --json docs/bench/regions-1e9.json --plot docs/bench/regions-1e9.png

Each relay reaches the origin bucket and its regional bucket through
`netlab.py s3-router` (object_store takes one `AWS_ENDPOINT` for every store
a process opens; the router forwards by bucket: `origin` across the link,
everything else to the regional moto); publisher and subscribers talk to
their moto directly.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import netlab  # noqa: E402

KEY = "bench-regions-notify-key"
ORIGIN_BUCKET = "origin"
PREFIX = "policy"
MOTO_PORT = 5000
ROUTER_PORT = 5100
RELAY_PORT = 7000
SUB_PORT = 7100
PUBLISHER_PORT = 7200
PUBLISHER_TOKEN = "bench-regions-publisher-token"
MIB = 1 << 20
REPO = Path(__file__).resolve().parent.parent


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def base_env(endpoint: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a weightcast process talking to one S3 endpoint:
    moto's dummy keys, nothing inherited that could redirect it (proxies,
    other stores' settings)."""
    drop = ("AWS_", "WEIGHTCAST_", "HF_", "GOOGLE_", "AZURE_")
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(drop) and not k.lower().endswith("_proxy")
    }
    env.update(
        AWS_ENDPOINT=endpoint,
        AWS_ALLOW_HTTP="true",
        AWS_ACCESS_KEY_ID="test",
        AWS_SECRET_ACCESS_KEY="test",
        AWS_REGION="us-east-1",
        RUST_LOG=os.environ.get("BENCH_LOG", "weightcast=info"),
        NO_COLOR="1",
    )
    env.update(extra or {})
    return env


class Lines:
    """Reads a process's stdout in a thread: (monotonic time, parsed JSON)."""

    def __init__(self, proc: subprocess.Popen, name: str):
        self.proc, self.name = proc, name
        self.items: list[tuple[float, dict]] = []
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for raw in self.proc.stdout:
            t = time.monotonic()
            try:
                obj = json.loads(raw)
            except ValueError:
                continue
            if isinstance(obj, dict):
                with self.lock:
                    self.items.append((t, obj))

    def snapshot(self) -> list[tuple[float, dict]]:
        with self.lock:
            return list(self.items)


class Sampler:
    """The lowest MemAvailable seen, sampled every half second."""

    def __init__(self):
        self.min_available = None
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    @staticmethod
    def available() -> int:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        return 0

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            a = self.available()
            self.min_available = a if self.min_available is None else min(self.min_available, a)

    def stop(self) -> None:
        self._stop.set()


# -- checkpoint comparison -------------------------------------------------------


def safetensors_digests(path: Path) -> dict[str, tuple[str, tuple, str]]:
    """name -> (dtype, shape, BLAKE2b of the tensor's bytes)."""
    out = {}
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n > 100 * MIB:
            raise ValueError(f"{path}: header length {n} is not plausible")
        header = json.loads(f.read(n))
        base = 8 + n
        entries = sorted(
            ((k, v) for k, v in header.items() if k != "__metadata__"),
            key=lambda kv: kv[1]["data_offsets"][0],
        )
        for name, info in entries:
            a, b = info["data_offsets"]
            f.seek(base + a)
            h = hashlib.blake2b(digest_size=32)
            left = b - a
            while left > 0:
                chunk = f.read(min(left, 8 * MIB))
                if not chunk:
                    raise ValueError(f"{path}: tensor {name} truncated")
                h.update(chunk)
                left -= len(chunk)
            out[name] = (info["dtype"], tuple(info["shape"]), h.hexdigest())
    return out


def checkpoint_digests(root: Path) -> dict[str, object]:
    """Every tensor (keyed `file:tensor`) and every other file (keyed by
    path) of a checkpoint directory."""
    out: dict[str, object] = {}
    for p in sorted(root.rglob("*")):
        if not p.is_file() or p.name.startswith("."):
            continue
        rel = str(p.relative_to(root))
        if p.suffix == ".safetensors":
            for name, d in safetensors_digests(p).items():
                out[f"{rel}:{name}"] = d
        else:
            out[rel] = hashlib.blake2b(p.read_bytes(), digest_size=32).hexdigest()
    return out


def compare(want: dict[str, object], got: dict[str, object]) -> str | None:
    """None when identical, else what differs (first few)."""
    problems = []
    for k in sorted(set(want) | set(got)):
        if k not in got:
            problems.append(f"missing {k}")
        elif k not in want:
            problems.append(f"extra {k}")
        elif want[k] != got[k]:
            problems.append(f"differs {k}")
        if len(problems) >= 5:
            break
    return "; ".join(problems) or None


# -- the scenario ----------------------------------------------------------------


@dataclass
class Region:
    index: int
    ns: str
    link: netlab.Link
    bucket: str
    relay: subprocess.Popen | None = None
    relay_lines: Lines | None = None
    watch: Lines | None = None
    subs: list[dict] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"r{self.index}"


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.work = Path(args.work).resolve()
        self.out_root = Path(args.out_root).resolve() if args.out_root else self.work
        self.lab = netlab.Lab(prefix="wcreg")
        self.origin = self.lab.namespace("origin")
        rate = args.link_mbps * 8  # MB/s -> megabit/s
        self.regions = []
        for r in range(args.regions):
            ns = self.lab.namespace(f"r{r}")
            link = self.lab.link(self.origin, ns, rate_mbit=rate, burst=args.burst, latency="50ms")
            self.regions.append(Region(r, ns, link, f"region{r}"))
        self.logs = Path(args.logs).resolve() if args.logs else self.work / "logs"
        self.partial: dict = {}
        self.logs.mkdir(parents=True, exist_ok=True)

    # -- helpers --

    def moto(self, ns: str, host: str, name: str) -> subprocess.Popen:
        tmp = self.work / f"moto-{name}"
        tmp.mkdir(parents=True, exist_ok=True)
        # Large buffers (16 MiB parts, ranged reads) from mmap, returned on
        # free (glibc's dynamic threshold keeps them in the heap otherwise):
        # peak RSS 696 MB instead of 875 MB in a 300 MB full-mode run.
        env = base_env("", {"TMPDIR": str(tmp), "MALLOC_MMAP_THRESHOLD_": str(1 << 20)})
        p = self.lab.tool(ns, ["moto", host, str(MOTO_PORT)], env=env, log=self.logs / f"moto-{name}.log")
        self.lab.wait_http(ns, f"http://127.0.0.1:{MOTO_PORT}/", timeout=60, proc=p)
        return p

    def bucket(self, ns: str, name: str) -> None:
        self.lab.run(ns, ["curl", "-sSf", "-X", "PUT", f"http://127.0.0.1:{MOTO_PORT}/{name}"])

    def wc(self, *args: str) -> list[str]:
        return [str(self.args.bin), *args]

    # -- the raw link --

    def link_test(self) -> dict:
        mb = self.args.link_test_mb
        log(f"link test: a {mb} MB object on the origin's moto")
        moto = self.moto(self.origin, "0.0.0.0", "linktest")
        self.bucket(self.origin, "linktest")
        blob = self.work / "linktest.bin"
        with open(blob, "wb") as f:
            for _ in range(mb):
                f.write(os.urandom(1_000_000))
        url = f"http://127.0.0.1:{MOTO_PORT}/linktest/blob"
        self.lab.run(
            self.origin,
            ["curl", "-sSf", "-H", "x-amz-acl: public-read", "-T", str(blob), url],
            timeout=600,
        )
        blob.unlink()
        get = lambda ns, u: json.loads(self.lab.run(ns, [sys.executable, netlab.__file__, "http-get", u], timeout=900))  # noqa: E731
        out = {"object_bytes": mb * 1_000_000, "rate_mbit": self.args.link_mbps * 8, "burst": self.args.burst}
        local = get(self.origin, url)
        out["origin_loopback_MBps"] = local["bytes"] / local["seconds"] / 1e6
        one = []
        for reg in self.regions:
            c0 = reg.link.counters()
            r = get(reg.ns, f"http://{reg.link.addr_a}:{MOTO_PORT}/linktest/blob")
            crossed = reg.link.counters().minus(c0)
            one.append(
                {
                    "region": reg.name,
                    "MBps": r["bytes"] / r["seconds"] / 1e6,
                    "seconds": r["seconds"],
                    "link_bytes": crossed.total,
                }
            )
        out["one_link"] = one
        # All links at once (the origin's moto serving every region).
        procs = [
            self.lab.tool(
                reg.ns,
                ["http-get", f"http://{reg.link.addr_a}:{MOTO_PORT}/linktest/blob"],
                stdout=subprocess.PIPE,
            )
            for reg in self.regions
        ]
        together = []
        for reg, p in zip(self.regions, procs):
            text, _ = p.communicate(timeout=900)
            r = json.loads(text)
            together.append({"region": reg.name, "MBps": r["bytes"] / r["seconds"] / 1e6})
            self.lab.procs.remove(p)
        out["all_links_at_once"] = together
        self.lab.stop(moto)
        shutil.rmtree(self.work / "moto-linktest", ignore_errors=True)
        log(
            "link test: origin loopback {:.0f} MB/s; one link {}; all at once {}".format(
                out["origin_loopback_MBps"],
                ", ".join(f"{x['MBps']:.1f}" for x in one),
                ", ".join(f"{x['MBps']:.1f}" for x in together),
            )
        )
        return out

    # -- one mode --

    def run_mode(self, mode: str) -> dict:
        a = self.args
        mdir = self.work / mode
        for d in (mdir, self.out_root / mode):
            if d.exists():
                shutil.rmtree(d)
        mdir.mkdir(parents=True)
        started = []  # processes of this mode, stopped at its end

        def keep(p):
            started.append(p)
            return p

        log(f"[{mode}] starting servers")
        keep(self.moto(self.origin, "0.0.0.0", f"{mode}-origin"))
        self.bucket(self.origin, ORIGIN_BUCKET)
        for reg in self.regions:
            keep(self.moto(reg.ns, "127.0.0.1", f"{mode}-{reg.name}"))
            self.bucket(reg.ns, reg.bucket)
            router = keep(
                self.lab.tool(
                    reg.ns,
                    [
                        "s3-router",
                        "--listen",
                        f"127.0.0.1:{ROUTER_PORT}",
                        "--route",
                        f"{ORIGIN_BUCKET}={reg.link.addr_a}:{MOTO_PORT}",
                        "--default",
                        f"127.0.0.1:{MOTO_PORT}",
                    ],
                    log=self.logs / f"router-{mode}-{reg.name}.log",
                )
            )
            self.lab.wait_http(reg.ns, f"http://127.0.0.1:{ROUTER_PORT}/{reg.bucket}", proc=router)
            listen = f"{reg.link.addr_b}:{RELAY_PORT}"
            reg.relay = keep(
                self.lab.spawn(
                    reg.ns,
                    self.wc(
                        "relay",
                        "--from",
                        f"s3://{ORIGIN_BUCKET}/{PREFIX}",
                        "--to",
                        f"s3://{reg.bucket}/{PREFIX}",
                        "--listen",
                        listen,
                        "--notify-key",
                        KEY,
                        "--interval",
                        str(a.relay_interval),
                    ),
                    env=base_env(f"http://127.0.0.1:{ROUTER_PORT}"),
                    log=self.logs / f"relay-{mode}-{reg.name}.log",
                    stdout=subprocess.PIPE,
                )
            )
            reg.relay_lines = Lines(reg.relay, f"relay {reg.name}")
            self.lab.wait_http(reg.ns, f"http://{listen}/healthz", proc=reg.relay)
            reg.subs = []
            for s in range(a.subscribers):
                out = self.out_root / mode / reg.name / f"s{s}"
                port = SUB_PORT + s
                p = keep(
                    self.lab.spawn(
                        reg.ns,
                        self.wc(
                            "subscribe",
                            "-q",
                            "--store",
                            f"s3://{reg.bucket}/{PREFIX}",
                            "--out",
                            str(out),
                            "--listen",
                            f"127.0.0.1:{port}",
                            "--id",
                            f"{reg.name}-s{s}",
                            "--notify-key",
                            KEY,
                            "--poll-interval",
                            str(a.poll_interval),
                        ),
                        env=base_env(f"http://127.0.0.1:{MOTO_PORT}"),
                        log=self.logs / f"sub-{mode}-{reg.name}-s{s}.log",
                    )
                )
                url = f"http://127.0.0.1:{port}/v1/status"
                reg.subs.append({"id": f"{reg.name}-s{s}", "out": out, "url": url, "proc": p})
            for sub in reg.subs:
                self.lab.wait_http(reg.ns, sub["url"], proc=sub["proc"])
            watch = keep(
                self.lab.tool(
                    reg.ns,
                    ["watch", "--interval", "0.05", *[s["url"] for s in reg.subs]],
                    stdout=subprocess.PIPE,
                    log=self.logs / f"watch-{mode}-{reg.name}.log",
                )
            )
            reg.watch = Lines(watch, f"watch {reg.name}")
            self.wait_registered(reg)

        ckpt = mdir / "checkpoint"
        model_log = open(self.logs / f"model-{mode}.log", "ab")
        model = keep(
            subprocess.Popen(
                [
                    str(a.model_bin),
                    "--elements",
                    str(int(a.elements)),
                    "--shards",
                    str(a.shards),
                    "--lr",
                    str(a.lr),
                    "--out",
                    str(ckpt),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=model_log,
                text=True,
                preexec_fn=netlab.die_with_parent,
            )
        )
        model_log.close()
        self.lab.procs.append(model)

        def model_line() -> dict:
            line = model.stdout.readline()
            if not line:
                raise RuntimeError(f"bench_model exited ({model.wait()}); see {self.logs}/model-{mode}.log")
            return json.loads(line)

        mode_flags = ["--anchor-every", "1", "--anchor-encoding", "raw"] if mode == "full" else []
        notify = []
        for reg in self.regions:
            notify += ["--notify", f"http://{reg.link.addr_b}:{RELAY_PORT}/v1/notify"]
        state = (Path(a.state_root) / f"publisher-state-{mode}") if a.state_root else mdir / "publisher-state"
        shutil.rmtree(state, ignore_errors=True)
        publisher_args = [
            "--store", f"s3://{ORIGIN_BUCKET}/{PREFIX}", "--state", str(state),
            "--notify-key", KEY, *notify, *mode_flags,
        ]
        if a.publisher == "daemon":
            # As a training loop runs it: one daemon, one POST per version
            # (the one-shot command verifies the whole snapshot at each start).
            daemon = keep(
                self.lab.spawn(
                    self.origin,
                    self.wc(
                        "publisher", *publisher_args, "--token", PUBLISHER_TOKEN,
                        "--checkpoint-root", str(ckpt.parent),
                        "--listen", f"127.0.0.1:{PUBLISHER_PORT}",
                    ),
                    env=base_env(f"http://127.0.0.1:{MOTO_PORT}"),
                    log=self.logs / f"publisher-{mode}.log",
                )
            )
            self.lab.wait_http(self.origin, f"http://127.0.0.1:{PUBLISHER_PORT}/healthz", proc=daemon)
        versions = []
        self.partial[mode] = {"versions": versions}  # what a failed run still reports
        for v in range(a.deltas + 1):
            if v > 0:
                model.stdin.write("next\n")
                model.stdin.flush()
            step = model_line()
            log(f"[{mode}] v{v}: checkpoint written ({step['changed']} elements changed, {step['seconds']:.1f} s)")
            before = {reg.name: reg.link.counters() for reg in self.regions}
            t0 = time.monotonic()
            if a.publisher == "daemon":
                body = json.dumps({"checkpoint": str(ckpt), "step": v + 1})
                out = self.lab.run(
                    self.origin,
                    ["curl", "-sS", "--fail-with-body", "-X", "POST",
                     "-H", f"Authorization: Bearer {PUBLISHER_TOKEN}",
                     "-H", "Content-Type: application/json", "--data", body,
                     f"http://127.0.0.1:{PUBLISHER_PORT}/v1/publish"],
                    timeout=a.version_timeout,
                )
            else:
                out = self.lab.run(
                    self.origin,
                    self.wc("publish", "-q", "--checkpoint", str(ckpt), *publisher_args),
                    timeout=a.version_timeout,
                    env=base_env(f"http://127.0.0.1:{MOTO_PORT}"),
                )
            t_pub = time.monotonic()
            published = json.loads(out.strip().splitlines()[-1])
            if published["version"] != v:
                raise RuntimeError(f"publish committed version {published['version']}, expected {v}")
            arrivals = self.wait_fleet(v, t0, a.version_timeout)
            t_fleet = max(arrivals.values())
            crossed = self.settle_counters(before)
            relayed = {}
            for reg in self.regions:
                for t, obj in reg.relay_lines.snapshot():
                    if v in obj.get("versions", []):
                        relayed[reg.name] = {"seconds": t - t0, "bytes": obj.get("bytes"), "objects": obj.get("objects")}
            row = {
                "version": v,
                "kind": published["kind"],
                "changed": published.get("changed"),
                "elements": published.get("total"),
                "published_bytes": published["bytes"],
                "bridge_bytes": published.get("bridge_bytes", 0),
                "notified": published.get("notified"),
                "publish_seconds": t_pub - t0,
                "fleet_seconds": t_fleet - t0,
                "subscriber_seconds": {k: t - t0 for k, t in sorted(arrivals.items())},
                "relay": relayed,
                "link_bytes": {
                    name: {"origin_to_region": c.a_to_b, "region_to_origin": c.b_to_a, "total": c.total}
                    for name, c in crossed.items()
                },
            }
            if len(relayed) == len(self.regions):
                last_relay = max(x["seconds"] for x in relayed.values())
                row["stages"] = {
                    "publish": row["publish_seconds"],
                    "relay": last_relay - row["publish_seconds"],
                    "subscribers": row["fleet_seconds"] - last_relay,
                }
                # Only meaningful for large versions: a delta's relay can
                # even finish before the publish process has exited.
                row["relay_MBps"] = {
                    name: (x["bytes"] or 0) / 1e6 / (x["seconds"] - row["publish_seconds"])
                    for name, x in relayed.items()
                    if (x["bytes"] or 0) >= 64 * MIB and x["seconds"] - row["publish_seconds"] > 0.5
                }
            row["link_over_published"] = {
                name: c["total"] / max(1, published["bytes"]) for name, c in row["link_bytes"].items()
            }
            versions.append(row)
            log(
                f"[{mode}] v{v} {published['kind']}: publish {row['publish_seconds']:.2f} s, "
                f"fleet {row['fleet_seconds']:.2f} s, published {published['bytes'] / MIB:.1f} MiB, link "
                + ", ".join(f"{n} {c['total'] / MIB:.1f} MiB" for n, c in row["link_bytes"].items())
            )

        checks = self.verify(mode, ckpt, versions)
        model.stdin.close()
        for p in reversed(started):
            self.lab.stop(p)
        for reg in self.regions:
            reg.relay = reg.relay_lines = reg.watch = None
        if not a.keep:
            shutil.rmtree(state, ignore_errors=True)
            shutil.rmtree(mdir, ignore_errors=True)
            shutil.rmtree(self.out_root / mode, ignore_errors=True)
            for reg in ["origin", *[r.name for r in self.regions]]:
                shutil.rmtree(self.work / f"moto-{mode}-{reg}", ignore_errors=True)
        return {"versions": versions, "checks": checks}

    def wait_registered(self, reg: Region) -> None:
        """Waits until the region's subscribers are registered in its bucket
        (the relay notifies the registrations it finds there)."""
        deadline = time.monotonic() + 60
        while True:
            out = self.lab.run(
                reg.ns,
                self.wc("status", "--store", f"s3://{reg.bucket}/{PREFIX}"),
                env=base_env(f"http://127.0.0.1:{MOTO_PORT}"),
            )
            n = len(json.loads(out).get("subscribers", []))
            if n >= len(reg.subs):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{reg.name}: {n} of {len(reg.subs)} subscribers registered after 60 s")
            time.sleep(0.2)

    def wait_fleet(self, v: int, t0: float, timeout: float) -> dict[str, float]:
        """When each subscriber first reported version >= v (monotonic)."""
        deadline = t0 + timeout
        while True:
            arrivals, missing = {}, []
            for reg in self.regions:
                seen = reg.watch.snapshot()
                for sub in reg.subs:
                    t = next(
                        (
                            t
                            for t, o in seen
                            if o.get("url") == sub["url"] and o.get("version") is not None and o["version"] >= v
                        ),
                        None,
                    )
                    if t is None:
                        missing.append(sub["id"])
                    else:
                        arrivals[sub["id"]] = t
            if not missing:
                return arrivals
            for reg in self.regions:
                for p, what in [(reg.relay, f"relay {reg.name}"), *[(s["proc"], s["id"]) for s in reg.subs]]:
                    if p.poll() is not None:
                        raise RuntimeError(f"{what} exited ({p.returncode}); see {self.logs}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"version {v}: {', '.join(missing)} did not get it within {timeout} s")
            time.sleep(0.05)

    def settle_counters(self, before: dict) -> dict:
        """Link bytes since `before`, read once the links are quiet (no byte
        for 0.5 s, at most 5 s)."""
        last, quiet_since, end = None, time.monotonic(), time.monotonic() + 5
        while True:
            now = {reg.name: reg.link.counters().minus(before[reg.name]) for reg in self.regions}
            if now != last:
                last, quiet_since = now, time.monotonic()
            elif time.monotonic() - quiet_since >= 0.5 or time.monotonic() > end:
                return now
            time.sleep(0.1)

    def verify(self, mode: str, ckpt: Path, versions: list[dict]) -> dict:
        last = versions[-1]["version"]
        log(f"[{mode}] verifying every subscriber against the trainer's checkpoint")
        want = checkpoint_digests(ckpt)
        failures = []
        for reg in self.regions:
            for sub in reg.subs:
                got = checkpoint_digests(sub["out"] / "current")
                diff = compare(want, got)
                if diff:
                    failures.append(f"{sub['id']}: {diff}")
        # What each subscriber reports now (its newest /v1/status).
        holds, stale = True, []
        for reg in self.regions:
            seen = reg.watch.snapshot()
            for sub in reg.subs:
                now = [o.get("version") for _, o in seen if o.get("url") == sub["url"]]
                if not now or now[-1] != last:
                    holds = False
                    stale.append(f"{sub['id']}: reports version {now[-1] if now else None}, not {last}")
        bound = []
        for row in versions:
            if row["kind"] != "delta":
                continue
            limit = 3 * row["published_bytes"] + MIB
            for name, c in row["link_bytes"].items():
                if c["total"] >= limit:
                    bound.append(f"v{row['version']} {name}: {c['total']} bytes >= 3 x {row['published_bytes']} + 1 MiB")
        checks = {
            "last_version": last,
            "every_subscriber_holds_last": holds,
            "holds_last_failures": stale,
            "bit_identical": not failures,
            "bit_identical_failures": failures,
            "tensors_compared": sum(1 for k in want if ":" in k),
            "files_compared": sum(1 for k in want if ":" not in k),
            "one_copy_per_region": not bound,
            "one_copy_per_region_failures": bound,
        }
        checks["ok"] = holds and not failures and not bound
        log(f"[{mode}] checks: {'ok' if checks['ok'] else 'FAILED: ' + '; '.join(stale + failures + bound)}")
        return checks


# -- report ------------------------------------------------------------------------


def table(mode: str, res: dict, regions: list[str]) -> str:
    head = [
        "v", "kind", "publish s", "relay s", "subscribers s", "time-to-fleet s",
        *[f"link {r} MiB" for r in regions], "published MiB", "link/published",
    ]
    rows = []
    for row in res["versions"]:
        rows.append(
            [
                str(row["version"]),
                row["kind"],
                f"{row['publish_seconds']:.2f}",
                f"{row['stages']['relay']:.2f}" if "stages" in row else "-",
                f"{row['stages']['subscribers']:.2f}" if "stages" in row else "-",
                f"{row['fleet_seconds']:.2f}",
                *[f"{row['link_bytes'][r]['total'] / MIB:.2f}" for r in regions],
                f"{row['published_bytes'] / MIB:.2f}",
                " ".join(f"{row['link_over_published'][r]:.3f}" for r in regions),
            ]
        )
    lines = [f"mode {mode}", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def print_report(report: dict) -> None:
    """The link test, one table per mode, the ratio and the checks."""
    linktest, results = report["link_test"], report["modes"]
    modes = list(results)
    regions = sorted(results[modes[0]]["versions"][0]["link_bytes"])
    print()
    print(
        f"link test ({linktest['object_bytes'] / 1e6:.0f} MB GET from the origin's moto): loopback "
        f"{linktest['origin_loopback_MBps']:.0f} MB/s; through one link "
        + ", ".join(f"{x['region']} {x['MBps']:.1f}" for x in linktest["one_link"])
        + " MB/s; all links at once "
        + ", ".join(f"{x['region']} {x['MBps']:.1f}" for x in linktest["all_links_at_once"])
        + " MB/s"
    )
    for m in modes:
        print()
        print(table(m, results[m], regions))
    s = report["summary"]
    if "full_over_delta_time_to_fleet" in s:
        print()
        print(
            "full / delta time-to-fleet, delta versions: "
            + ", ".join(f"v{v} {r:.1f}x" for v, r in s["full_over_delta_time_to_fleet"].items())
            + f" (median {s['full_over_delta_time_to_fleet_median']:.1f}x; goal >= 30x)"
        )
    if "full_link_bound_over_delta" in s:
        print(
            "the same with the full baseline's relay stage at the measured link rate: "
            + ", ".join(f"v{v} {r:.1f}x" for v, r in s["full_link_bound_over_delta"].items())
            + f" (median {s['full_link_bound_over_delta_median']:.1f}x)"
        )
    for m in modes:
        c = results[m]["checks"]
        print(
            f"checks {m}: {'ok' if c['ok'] else 'FAILED'} (subscribers hold v{c['last_version']}: "
            f"{c['every_subscriber_holds_last']}, bit-identical: {c['bit_identical']} "
            f"({c['tensors_compared']} tensors, {c['files_compared']} files), one copy per region: "
            f"{c['one_copy_per_region']})"
        )
    print(f"wall time {report['wall_seconds']:.0f} s")


def summarize(results: dict, link_rate: float | None = None) -> dict:
    out = {}
    if "delta" in results and "full" in results:
        d = {r["version"]: r for r in results["delta"]["versions"]}
        f = {r["version"]: r for r in results["full"]["versions"]}
        ratios = {
            v: f[v]["fleet_seconds"] / d[v]["fleet_seconds"]
            for v in sorted(d)
            if v in f and d[v]["kind"] == "delta"
        }
        if ratios:
            out["full_over_delta_time_to_fleet"] = ratios
            out["full_over_delta_time_to_fleet_median"] = statistics.median(ratios.values())
            out["full_over_delta_time_to_fleet_min"] = min(ratios.values())
            dl = [d[v]["fleet_seconds"] for v in ratios]
            fl = [f[v]["fleet_seconds"] for v in ratios]
            out["delta_time_to_fleet_mean"] = statistics.mean(dl)
            out["full_time_to_fleet_mean"] = statistics.mean(fl)
            # The full baseline with its relay stage at the link's measured
            # rate instead of what the relays achieved on this machine.
            rate = link_rate * 1e6 if link_rate else None
            if rate and all("stages" in f[v] for v in ratios):
                bound = {
                    v: f[v]["stages"]["publish"]
                    + f[v]["published_bytes"] / rate
                    + f[v]["stages"]["subscribers"]
                    for v in ratios
                }
                out["full_link_bound_time_to_fleet"] = bound
                out["full_link_bound_over_delta"] = {v: bound[v] / d[v]["fleet_seconds"] for v in ratios}
                out["full_link_bound_over_delta_median"] = statistics.median(out["full_link_bound_over_delta"].values())
    return out


def plot(report: dict, path: Path) -> None:
    """Time-to-fleet per version and bytes per link per version, delta vs full."""
    results = report["modes"]
    sc = report["scenario"]
    title = (
        f"{sc['elements'] / 1e9:.2f}e9 bf16 elements, {sc['regions']} regions x "
        f"{sc['subscribers_per_region']} subscribers, {sc['link_MBps_each_way']:g} MB/s links (tbf), "
        f"{report['machine']['cpus']} cores"
    )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit(f"--plot needs matplotlib ({e}); install it or leave --plot out") from e
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    modes = [m for m in ("delta", "full") if m in results]
    colors = {"delta": ("#08519c", "#4292c6", "#9ecae1"), "full": ("#a63603", "#f16913", "#fdae6b")}
    width = 0.38
    for i, m in enumerate(modes):
        rows = results[m]["versions"]
        vs = [r["version"] for r in rows]
        xs = [v + (i - (len(modes) - 1) / 2) * width for v in vs]
        if all("stages" in r for r in rows):
            bottom = [0.0] * len(rows)
            for k, stage in enumerate(("publish", "relay", "subscribers")):
                h = [max(0.0, r["stages"][stage]) for r in rows]
                ax1.bar(xs, h, width, bottom=bottom, color=colors[m][k], label=f"{m}: {stage}")
                bottom = [b + x for b, x in zip(bottom, h)]
        else:
            ax1.bar(xs, [r["fleet_seconds"] for r in rows], width, color=colors[m][0], label=f"{m}: time-to-fleet")
        for x, r in zip(xs, rows):
            ax1.annotate(f"{r['fleet_seconds']:.1f}", (x, r["fleet_seconds"]), ha="center", va="bottom", fontsize=7)
        regions = sorted(rows[0]["link_bytes"])
        for j, reg in enumerate(regions):
            ax2.plot(vs, [r["link_bytes"][reg]["total"] for r in rows], color=colors[m][j % 2],
                     marker="o" if m == "delta" else "s", linestyle="-" if j == 0 else "--",
                     label=f"{m}: link {reg}")
        ax2.plot(vs, [r["published_bytes"] for r in rows], color="gray", linestyle=":",
                 marker="x", label=f"{m}: the version's objects")
    ticks = sorted({r["version"] for m in modes for r in results[m]["versions"]})
    ax2.set_xticks(ticks)
    ax1.set_xlabel("version (0 = anchor)")
    ax1.set_ylabel("seconds")
    ax1.set_title("time-to-fleet: publish start to the last subscriber")
    ax1.set_xticks(ticks)
    top = max(r["fleet_seconds"] for m in modes for r in results[m]["versions"])
    ax1.set_ylim(0, top * 1.45)
    ax1.legend(fontsize=7, ncol=2, loc="upper right")
    ax2.set_yscale("log")
    ax2.set_xlabel("version (0 = anchor)")
    ax2.set_ylabel("bytes across the link (both directions)")
    ax2.set_title("bytes per inter-region link")
    ax2.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true",
                    help="CI preset: ~18M elements, 2 regions x 2 subscribers, anchor + 2 deltas; checks assert")
    ap.add_argument("--check", action="store_true", help="exit non-zero when a check fails (always with --small)")
    ap.add_argument("--elements", type=float, default=1e9, help="model size in bf16 elements (1e9)")
    ap.add_argument("--shards", type=int, default=4, help="safetensors shard files (4)")
    ap.add_argument("--lr", type=float, default=1.5e-6, help="generator learning rate (1.5e-6)")
    ap.add_argument("--regions", type=int, default=2, help="regions (2)")
    ap.add_argument("--subscribers", type=int, default=3, help="subscribers per region (3)")
    ap.add_argument("--deltas", type=int, default=3, help="versions after the first (3)")
    ap.add_argument("--link-mbps", type=float, default=100.0, help="link rate each way in MB/s (100 = 800mbit)")
    ap.add_argument("--burst", default="512kb", help="tbf burst (512kb)")
    ap.add_argument("--link-test-mb", type=int, default=256, help="size of the raw link test object in MB (256)")
    ap.add_argument("--modes", default="delta,full", help="modes to run, comma-separated (delta,full)")
    ap.add_argument("--relay-interval", type=float, default=5.0, help="relay poll interval, s (5; wake-up is the notification)")
    ap.add_argument("--poll-interval", type=float, default=30.0,
                    help="subscriber poll interval, s (30; wake-up is the relay's notification)")
    ap.add_argument("--version-timeout", type=float, default=1800.0, help="seconds a version may take (1800)")
    ap.add_argument("--work", default=None, help="work directory on disk (default /var/tmp/wc-regions-PID)")
    ap.add_argument("--out-root", default=None,
                    help="where the subscribers' output directories go (default: under --work), e.g. /dev/shm/...")
    ap.add_argument("--publisher", choices=("daemon", "once"), default="daemon",
                    help="`publisher` daemon sent one POST per version (as a training loop runs it), "
                    "or `publish` once per version (verifies its whole snapshot at each start) (daemon)")
    ap.add_argument("--state-root", default=None,
                    help="where the publisher's snapshot goes (default: under --work), e.g. /dev/shm/...")
    ap.add_argument("--keep", action="store_true",
                    help="keep the work directory (both modes' buckets, checkpoints and outputs: disk and, "
                    "with --out-root on tmpfs, memory)")
    ap.add_argument("--logs", default=None, help="where the processes' logs go (default: WORK/logs, removed with it)")
    ap.add_argument("--bin", default=str(REPO / "target/release/weightcast"), help="the weightcast binary")
    ap.add_argument("--model-bin", default=str(REPO / "target/release/examples/bench_model"), help="bench_model")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--plot", type=Path, help="write the figure here (PNG, needs matplotlib)")
    ap.add_argument("--from-json", type=Path, metavar="FILE",
                    help="run nothing: print the report of an earlier --json FILE (and --plot it)")
    a = ap.parse_args(argv)
    if a.from_json:
        report = json.loads(a.from_json.read_text())
        print_report(report)
        if a.plot:
            plot(report, a.plot)
        return 0
    if a.small:
        a.elements, a.regions, a.subscribers, a.deltas, a.shards = 4e6, 2, 2, 2, 2
        a.link_test_mb, a.version_timeout, a.check = 64, 120.0, True
    if a.work is None:
        a.work = f"/var/tmp/wc-regions-{os.getpid()}"
    a.bin, a.model_bin = Path(a.bin), Path(a.model_bin)
    for p, what in ((a.bin, "--bin"), (a.model_bin, "--model-bin")):
        if not os.access(p, os.X_OK):
            raise SystemExit(
                f"{what} {p}: not an executable; build with "
                "`cargo build --release --bin weightcast && cargo build --release -p weightcast-core --example bench_model`"
            )
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if not modes or any(m not in ("delta", "full") for m in modes):
        raise SystemExit(f"--modes {a.modes}: expected delta, full or both")
    if a.regions < 1 or a.subscribers < 1 or a.deltas < 0 or not 1 <= a.regions <= 200 or a.subscribers > 900:
        raise SystemExit("--regions 1..200, --subscribers 1..900, --deltas >= 0")
    try:
        import moto  # noqa: F401
    except ImportError:
        raise SystemExit(f"moto is not importable by {sys.executable}: run this with the test venv's Python")
    if shutil.which("curl") is None:
        raise SystemExit("curl not found on PATH")
    if a.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError as e:
            raise SystemExit(f"--plot needs matplotlib ({e})") from e

    started = time.monotonic()
    sampler = Sampler()
    bench = Bench(a)
    results: dict = {}
    linktest = None
    try:
        linktest = bench.link_test()
        for m in modes:
            results[m] = bench.run_mode(m)
    except BaseException as e:
        if a.json:
            a.json.parent.mkdir(parents=True, exist_ok=True)
            failed = {"error": f"{type(e).__name__}: {e}", "link_test": linktest, "partial": bench.partial}
            a.json.write_text(json.dumps(failed, indent=1) + "\n")
            log(f"the run failed; what it measured is in {a.json}")
        raise
    finally:
        bench.lab.close()
        sampler.stop()
        if not a.keep:
            shutil.rmtree(bench.work, ignore_errors=True)
            if a.out_root:
                for m in modes:
                    shutil.rmtree(bench.out_root / m, ignore_errors=True)
                try:
                    os.rmdir(a.out_root)  # only when empty: it may be shared
                except OSError:
                    pass
    report = {
        "scenario": {
            "elements_requested": a.elements,
            "elements": results[modes[0]]["versions"][0]["elements"],
            "shards": a.shards,
            "lr": a.lr,
            "regions": a.regions,
            "subscribers_per_region": a.subscribers,
            "versions": a.deltas + 1,
            "link_MBps_each_way": a.link_mbps,
            "relay_interval": a.relay_interval,
            "subscriber_poll_interval": a.poll_interval,
            "subscriber_output": a.out_root or a.work,
        },
        "machine": {
            "cpus": os.cpu_count(),
            "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            "min_memory_available_bytes": sampler.min_available,
            "kernel": platform.release(),
            "load_average_at_end": os.getloadavg(),
        },
        "link_test": linktest,
        "modes": results,
        "summary": summarize(results, min(x["MBps"] for x in linktest["all_links_at_once"])),
        "wall_seconds": time.monotonic() - started,
    }
    print_report(report)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(report, indent=1) + "\n")
    if a.plot:
        a.plot.parent.mkdir(parents=True, exist_ok=True)
        plot(report, a.plot)
    failed = [m for m in modes if not results[m]["checks"]["ok"]]
    if failed and a.check:
        print(f"FAILED: checks of {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
