#!/usr/bin/env python3
"""Anchors against the link (issue 27, item 4): publish and fresh bootstrap.

Writes `bench_e2e.py`'s bf16 model (`--elements`, `--shards` files), then,
for each repetition and each binary given with `--bin` (alternating, so that
two builds are compared under the same conditions):

1. `weightcast publish` of the checkpoint into a fresh prefix: the first
   version, an anchor (compressed `planes` objects), timed as a whole;
2. `weightcast subscribe --once` into a fresh directory: a fresh bootstrap
   (download, verify, decode, write the output files), timed as a whole and
   until the version is visible (its JSON's `fetch_s + prepare_s + pause_s +
   apply_s`; the rest of the run brings the second slot forward).

The store is moto (`scripts/netlab.py`'s, which serves ranged GETs from the
object's spool) or Garage (`--server garage`) in its own network namespace behind a veth pair shaped with
`tc tbf` to `--link-mbps` MB/s in each direction, or on loopback without a
link (`--link-mbps 0`). The object bytes of each run are read from the
bucket listing; their rate is compared with the nominal link and with what a
tuned client gets from the same server over the same link in the same run:
boto3 uploading and downloading the same number of bytes (multipart, 16 MiB
parts, 8 threads). Peak RssAnon is sampled from /proc every 2 ms; the CPU
seconds each command used (user + system) give the model bytes one core
sustains (`*_gb_s_per_core`).

    cargo build --release
    .ci-work/venv/bin/python scripts/bench_anchor.py --elements 1e9 --reps 2 \\
        --work /dev/shm/wcanchor --json docs/bench/anchor-link-1e9.json

Needs root (namespaces, tc) unless `--link-mbps 0`, numpy, boto3 and moto
(`.ci-work/venv/bin/python`, which `./scripts/test.sh` sets up).
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from bench_e2e import ShapedS3, run_measured, wait_http, write_model  # noqa: E402


class LoopbackS3:
    """netlab's moto on 127.0.0.1, no link in between."""

    def __init__(self):
        from bench_e2e import free_port

        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.p = subprocess.Popen(
            [sys.executable, str(ROOT / "scripts/netlab.py"), "--max-seconds", "14400",
             "moto", "127.0.0.1", str(port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_http(self.url, self.p, "moto on loopback")

    env = ShapedS3.env
    bucket = ShapedS3.bucket

    def cleanup(self):
        self.p.terminate()
        self.p.wait(10)


class GarageS3:
    """Garage 2.5 (Rust, `GARAGE` or `garage` on PATH) as the server: in its
    own namespace behind the shaped link, or on loopback when `mbps` is 0.
    Blocks are stored uncompressed in `data` (tmpfs keeps the disk out of it).
    Garage accepts conditional writes without enforcing them: the publisher
    runs with `--single-writer`."""

    publish_args = ["--single-writer"]

    def __init__(self, mbps: float, data: Path):
        import secrets

        from bench_e2e import free_port

        self.program = os.environ.get("GARAGE", "garage")
        if not shutil.which(self.program):
            sys.exit(f"Garage not found at `{self.program}`: set GARAGE to its binary "
                     "(./scripts/test.sh builds it under .ci-work/garage/bin)")
        self.lab, self.ns = None, None
        if mbps > 0:
            from netlab import HOST, Lab

            self.lab = Lab(prefix="wcanc", net=232)
            self.ns = self.lab.namespace("s3")
            link = self.lab.link(HOST, self.ns, rate_mbit=mbps * 8)
            host = link.addr_b
        else:
            host = "127.0.0.1"
        s3, rpc = free_port(), free_port()
        data.mkdir(parents=True, exist_ok=True)
        self.config = data / "garage.toml"
        self.config.write_text(
            f'metadata_dir = "{data / "meta"}"\ndata_dir = "{data / "data"}"\n'
            f'db_engine = "sqlite"\nreplication_factor = 1\ncompression_level = "none"\n'
            f'rpc_bind_addr = "127.0.0.1:{rpc}"\nrpc_public_addr = "127.0.0.1:{rpc}"\n'
            f'rpc_secret = "{secrets.token_hex(32)}"\n'
            f'[s3_api]\ns3_region = "garage"\napi_bind_addr = "{host}:{s3}"\n'
            f'root_domain = ".s3.garage.localhost"\n')
        argv = [self.program, "-c", str(self.config), "server"]
        log = data / "garage.log"
        if self.lab:
            self.p = self.lab.spawn(self.ns, argv, log=log)
        else:
            self.p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=open(log, "wb"))
        self.url = f"http://{host}:{s3}"
        for _ in range(300):
            try:
                self.cli("status")
                break
            except subprocess.CalledProcessError:
                if self.p.poll() is not None:
                    sys.exit(f"garage exited: {log.read_text()[-2000:]}")
                time.sleep(0.1)
        node = self.cli("node", "id", "-q").strip().split("@")[0]
        self.cli("layout", "assign", "-z", "dc1", "-c", "100G", node)
        self.cli("layout", "apply", "--version", "1")
        key = self.cli("key", "create", "bench")
        field = lambda label: next(l.split(":", 1)[1].strip() for l in key.splitlines()
                                   if l.strip().startswith(label))
        self.key_id, self.secret = field("Key ID"), field("Secret key")

    def cli(self, *args: str) -> str:
        argv = [self.program, "-c", str(self.config), *args]
        if self.ns:
            argv = ["ip", "netns", "exec", self.ns, *argv]
        return subprocess.run(argv, check=True, capture_output=True, text=True, timeout=60).stdout

    def env(self, base: dict) -> dict:
        e = dict(base)
        e.update(AWS_ENDPOINT=self.url, AWS_ALLOW_HTTP="true", AWS_ACCESS_KEY_ID=self.key_id,
                 AWS_SECRET_ACCESS_KEY=self.secret, AWS_REGION="garage")
        return e

    def bucket(self, name: str) -> None:
        self.cli("bucket", "create", name)
        self.cli("bucket", "allow", "--read", "--write", "--owner", name, "--key", "bench")

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.url, aws_access_key_id=self.key_id,
                            aws_secret_access_key=self.secret, region_name="garage")

    def cleanup(self):
        self.p.terminate()
        try:
            self.p.wait(10)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait(10)
        if self.lab:
            self.lab.close()


def moto_client(self):
    import boto3

    return boto3.client("s3", endpoint_url=self.url, aws_access_key_id="test",
                        aws_secret_access_key="test", region_name="us-east-1")


for cls in (ShapedS3, LoopbackS3):
    cls.client = moto_client
    cls.publish_args = []


def machine_cpu() -> tuple[float, float]:
    """Busy and total CPU seconds of the whole machine so far (/proc/stat)."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    idle = f[3] + f[4]  # idle + iowait
    tick = os.sysconf("SC_CLK_TCK")
    return (sum(f) - idle) / tick, sum(f) / tick


def process_cpu(pid: int | None) -> float:
    """CPU seconds (user + system) process `pid` has used, 0 without one."""
    if pid is None:
        return 0.0
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def server_pid(s3) -> int | None:
    """The S3 server's process id, where this script started it as one."""
    p = getattr(s3, "p", None)
    return p.pid if p is not None else None


def measured(cmd: list[str], env: dict, server_pid: int | None = None) -> dict:
    """`run_measured`, plus the CPU seconds (user + system) the command used,
    the server's CPU seconds meanwhile, and how busy the machine's cores were
    (busy / total CPU time over the command: 1.0 is every core saturated)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy0, total0 = machine_cpu()
    server0 = process_cpu(server_pid)
    r = run_measured(cmd, env)
    busy1, total1 = machine_cpu()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    r["cpu_s"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    r["server_cpu_s"] = process_cpu(server_pid) - server0
    r["machine_busy"] = (busy1 - busy0) / max(total1 - total0, 1e-9)
    return r


def prefix_bytes(s3, bucket: str, prefix: str, delete: bool = False) -> int:
    """Bytes of the objects under `prefix` (deleted afterwards with `delete`)."""
    total = 0
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        total += sum(o["Size"] for o in page.get("Contents", []))
        if delete:
            for o in page.get("Contents", []):
                s3.delete_object(Bucket=bucket, Key=o["Key"])
    return total


def tuned_client(s3, bucket: str, size: int, scratch: Path) -> dict:
    """boto3 moving `size` bytes up and down again (the same server and link)."""
    from boto3.s3.transfer import TransferConfig

    cfg = TransferConfig(multipart_chunksize=16 << 20, max_concurrency=8)
    scratch.mkdir(parents=True, exist_ok=True)
    src, dst = scratch / "probe.bin", scratch / "probe.back"
    with open(src, "wb") as f:
        left = size
        while left:
            n = min(left, 64 << 20)
            f.write(os.urandom(n))
            left -= n
    t = time.perf_counter()
    s3.upload_file(str(src), bucket, "probe.bin", Config=cfg)
    up = time.perf_counter() - t
    t = time.perf_counter()
    s3.download_file(bucket, "probe.bin", str(dst), Config=cfg)
    down = time.perf_counter() - t
    s3.delete_object(Bucket=bucket, Key="probe.bin")
    src.unlink()
    dst.unlink()
    return {"bytes": size, "upload_s": up, "download_s": down,
            "upload_mb_s": size / up / 1e6, "download_mb_s": size / down / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", type=float, default=1e9)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--link-mbps", type=float, default=100.0, help="MB/s; 0: loopback, no link")
    ap.add_argument("--work", default="/dev/shm/wcanchor", help="checkpoint, state, output")
    ap.add_argument("--server", choices=["moto", "garage"], default="moto")
    ap.add_argument("--bin", action="append", help="weightcast binaries to compare (repeatable)")
    ap.add_argument("--json")
    a = ap.parse_args()
    bins = a.bin or [str(ROOT / "target/release/weightcast")]
    work = Path(a.work)
    shutil.rmtree(work, ignore_errors=True)
    ckpt = work / "ckpt"
    elements = int(a.elements)
    write_model(ckpt, elements, a.shards, seed=1)
    model_bytes = sum(p.stat().st_size for p in ckpt.glob("model-*.safetensors"))
    if a.server == "garage":
        s3 = GarageS3(a.link_mbps, work / "garage")
    else:
        s3 = ShapedS3(a.link_mbps) if a.link_mbps > 0 else LoopbackS3()
    client = s3.client()
    rows = []
    try:
        base = {k: v for k, v in os.environ.items() if not k.startswith(("WEIGHTCAST_", "AWS_"))}
        env = s3.env(base)
        env["RUST_LOG"] = os.environ.get("BENCH_RUST_LOG", "weightcast=warn")
        s3.bucket("anchors")
        for rep in range(a.reps):
            for bi, b in enumerate(bins):
                prefix = f"r{rep}b{bi}"
                store = f"s3://anchors/{prefix}"
                state, out = work / "state", work / "out"
                for p in (state, out):
                    shutil.rmtree(p, ignore_errors=True)
                pub = measured([b, "publish", "--quiet", "--store", store, "--state", str(state),
                                    "--checkpoint", str(ckpt), *s3.publish_args], env,
                               server_pid(s3))
                if os.environ.get("BENCH_LOG_DIR"):  # the logs BENCH_RUST_LOG asked for
                    Path(os.environ["BENCH_LOG_DIR"], f"publish-r{rep}b{bi}.log").write_text(pub["stderr"])
                shutil.rmtree(state, ignore_errors=True)  # room on tmpfs
                objects = prefix_bytes(client, "anchors", prefix + "/")
                sub = measured([b, "subscribe", "--once", "--quiet", "--store", store,
                                    "--out", str(out)], env, server_pid(s3))
                if os.environ.get("BENCH_LOG_DIR"):
                    Path(os.environ["BENCH_LOG_DIR"], f"subscribe-r{rep}b{bi}.log").write_text(sub["stderr"])
                shutil.rmtree(out, ignore_errors=True)
                prefix_bytes(client, "anchors", prefix + "/", delete=True)  # room on tmpfs
                row = {"rep": rep, "bin": b, "object_bytes": objects, "model_bytes": model_bytes,
                       "publish_s": pub["seconds"], "publish_rss_anon_mib": pub["peak_rss_anon_mib"],
                       "bootstrap_s": sub["seconds"], "bootstrap_rss_anon_mib": sub["peak_rss_anon_mib"],
                       "publish_cpu_s": pub["cpu_s"], "bootstrap_cpu_s": sub["cpu_s"],
                       "publish_server_cpu_s": pub["server_cpu_s"],
                       "bootstrap_server_cpu_s": sub["server_cpu_s"],
                       "publish_machine_busy": pub["machine_busy"],
                       "bootstrap_machine_busy": sub["machine_busy"]}
                # Model bytes per CPU second: what one core sustains.
                row["publish_gb_s_per_core"] = model_bytes / pub["cpu_s"] / 1e9
                row["bootstrap_gb_s_per_core"] = model_bytes / sub["cpu_s"] / 1e9
                # Until the version is visible (the rest of the run brings the
                # second slot forward, after the switch).
                got = json.loads(sub["stdout"])
                row["bootstrap_visible_s"] = sum(got[k] for k in ("fetch_s", "prepare_s", "pause_s",
                                                                  "apply_s"))
                row["publish_mb_s"] = objects / row["publish_s"] / 1e6
                row["bootstrap_mb_s"] = objects / row["bootstrap_s"] / 1e6
                row["bootstrap_visible_mb_s"] = objects / row["bootstrap_visible_s"] / 1e6
                print(json.dumps(row), flush=True)
                rows.append(row)
            probe = tuned_client(client, "anchors", rows[-1]["object_bytes"], work / "probe")
            probe["rep"] = rep
            print(json.dumps(probe), flush=True)
            rows.append({"tuned_client": probe})
    finally:
        s3.cleanup()
        shutil.rmtree(work, ignore_errors=True)
    probes = [r["tuned_client"] for r in rows if "tuned_client" in r]
    summary = {"elements": elements, "link_mb_s": a.link_mbps or None, "server": a.server,
               "tuned_upload_mb_s": statistics.median(p["upload_mb_s"] for p in probes),
               "tuned_download_mb_s": statistics.median(p["download_mb_s"] for p in probes),
               "bins": {}}
    for b in bins:
        rs = [r for r in rows if r.get("bin") == b]
        s = {k: statistics.median(r[k] for r in rs)
             for k in ("publish_s", "bootstrap_s", "bootstrap_visible_s", "publish_mb_s",
                       "bootstrap_mb_s", "bootstrap_visible_mb_s",
                       "publish_rss_anon_mib", "bootstrap_rss_anon_mib", "publish_cpu_s",
                       "bootstrap_cpu_s", "publish_gb_s_per_core", "bootstrap_gb_s_per_core",
                       "publish_server_cpu_s", "bootstrap_server_cpu_s",
                       "publish_machine_busy", "bootstrap_machine_busy")}
        if a.link_mbps:
            s["publish_of_link"] = s["publish_mb_s"] / a.link_mbps
            s["bootstrap_of_link"] = s["bootstrap_mb_s"] / a.link_mbps
            s["bootstrap_visible_of_link"] = s["bootstrap_visible_mb_s"] / a.link_mbps
        s["publish_of_tuned"] = s["publish_mb_s"] / summary["tuned_upload_mb_s"]
        s["bootstrap_of_tuned"] = s["bootstrap_mb_s"] / summary["tuned_download_mb_s"]
        s["bootstrap_visible_of_tuned"] = (s["bootstrap_visible_mb_s"]
                                           / summary["tuned_download_mb_s"])
        summary["bins"][b] = s
    print(json.dumps(summary, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps({"summary": summary, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
