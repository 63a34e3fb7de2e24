#!/usr/bin/env python3
"""An emulated network on one machine, for benchmarks (root, iproute2, tc).

Network namespaces stand for sites (a training region, inference regions,
a bucket behind a slow link); veth pairs join them, each end shaped with a
token bucket (`tc qdisc add dev X root tbf rate R burst B latency L`), so a
link carries at most R in each direction. Processes run inside a namespace
(`ip netns exec NS ...`); per-link byte counters come from the kernel
(`ip -s -j link`).

    from netlab import Lab
    with Lab() as lab:
        origin, eu = lab.namespace("origin"), lab.namespace("eu")
        link = lab.link(origin, eu, rate_mbit=800)      # 100 MB/s each way
        p = lab.spawn(eu, ["some", "server"], log="/tmp/server.log")
        before = link.counters()
        ...
        crossed = link.counters().minus(before).total

Everything a Lab creates is removed when it closes — on leaving the `with`,
at interpreter exit, and on SIGTERM/SIGINT/SIGHUP: its processes are stopped
(SIGTERM, then SIGKILL after a grace period) and its namespaces deleted. The
processes also get SIGKILL from the kernel if the Python process that
started them dies (PR_SET_PDEATHSIG), and namespaces left by a Lab that was
killed outright are deleted by the next Lab with the same prefix (their names
carry the creating process's id).

Also here, as small command-line tools to run inside a namespace (the
calling Python process stays in its own; Python 3.11 has no setns):

- `python3 netlab.py moto HOST PORT`: moto's S3 server, serving ranged GETs
  from the object's spool file (stock moto 5 reads the whole object for every
  ranged GET: 128 reads of 2 GB for one 2 GB object read in 16 MiB parts).
- `python3 netlab.py s3-router --listen H:P --route BUCKET=H:P ... --default H:P`:
  a streaming HTTP/1.1 forwarder that sends each request to a server chosen by
  the first path segment (the bucket of a path-style S3 request). A process
  configured with one S3 endpoint (object_store reads `AWS_ENDPOINT` for
  every store it opens) can then reach buckets on two servers, e.g. a relay
  reading an origin bucket across a link and writing a local one.
- `python3 netlab.py watch --field version URL...`: polls JSON endpoints every
  `--interval` seconds and prints one JSON line per change of a field.
- `python3 netlab.py http-get URL`: GETs a URL, discards the body, prints
  `{"bytes": N, "seconds": S}` (a throughput probe without curl's buffering).

Every tool takes `--max-seconds` (a lifetime bound) so that nothing outlives
a benchmark that lost track of it.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Lab", "Link", "Counters", "NetlabError", "require_root", "die_with_parent"]


class NetlabError(RuntimeError):
    """A lab operation failed; the message names the command and its output."""


def require_root() -> None:
    """Refuses to go on without root, iproute2 and tc, saying what is missing."""
    if os.geteuid() != 0:
        raise NetlabError("network namespaces need root (run as root or under sudo)")
    for tool in ("ip", "tc"):
        if not any(
            os.access(os.path.join(d, tool), os.X_OK) for d in os.environ.get("PATH", "").split(":")
        ):
            raise NetlabError(f"`{tool}` not found on PATH (install iproute2)")


def _run(argv: list[str], timeout: float = 30.0, env: dict[str, str] | None = None,
         ns: str | None = None) -> str:
    """Runs `argv` (inside namespace `ns` when given) to completion; its stdout."""
    where = f"in {ns}: " if ns else ""
    full = ["ip", "netns", "exec", ns, *argv] if ns else argv
    try:
        r = subprocess.run(full, capture_output=True, text=True, timeout=timeout, env=env,
                           preexec_fn=die_with_parent if ns else None)
    except subprocess.TimeoutExpired as e:
        raise NetlabError(f"{where}`{' '.join(argv)}` did not finish within {timeout} s") from e
    if r.returncode != 0:
        raise NetlabError(
            f"{where}`{' '.join(argv)}` failed (exit {r.returncode}): {(r.stderr or r.stdout).strip()[-2000:]}"
        )
    return r.stdout


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_libc = None


def die_with_parent() -> None:
    """preexec_fn: SIGKILL this child when its parent thread dies."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    _libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass(frozen=True)
class Counters:
    """Bytes sent by each end of a link (each direction's traffic)."""

    a_to_b: int
    b_to_a: int

    @property
    def total(self) -> int:
        return self.a_to_b + self.b_to_a

    def minus(self, earlier: "Counters") -> "Counters":
        return Counters(self.a_to_b - earlier.a_to_b, self.b_to_a - earlier.b_to_a)


#: The machine's own network namespace, as an end of a link.
HOST = None


def _in(ns: str | None, tool: str) -> list[str]:
    """`ip`/`tc` acting in namespace `ns` (or the host's)."""
    return [tool] if ns is HOST else [tool, "-n", ns]


@dataclass
class Link:
    """A veth pair between two namespaces (or the host, `HOST`), `a` end and `b` end."""

    lab: "Lab"
    ns_a: str | None
    ns_b: str
    if_a: str
    if_b: str
    addr_a: str
    addr_b: str

    def counters(self) -> Counters:
        """tx bytes at each end (what left `a` towards `b`, and back)."""
        return Counters(self.lab.tx_bytes(self.ns_a, self.if_a), self.lab.tx_bytes(self.ns_b, self.if_b))


@dataclass
class Lab:
    """Namespaces, links and processes, all removed by `close()`."""

    prefix: str = "wcl"
    #: Second octet of the link subnets: link i gets 10.<net>.<i>.0/30.
    net: int = 213
    #: Seconds a stopped process gets between SIGTERM and SIGKILL.
    grace: float = 5.0
    namespaces: list[str] = field(default_factory=list)
    links: list[Link] = field(default_factory=list)
    procs: list[subprocess.Popen] = field(default_factory=list)
    _closed: bool = False

    def __post_init__(self) -> None:
        require_root()
        if not self.prefix.isalnum() or len(self.prefix) > 6:
            raise NetlabError(f"lab prefix `{self.prefix}`: 1 to 6 letters or digits")
        self._tag = f"{self.prefix}{os.getpid()}"
        self._remove_stale()
        atexit.register(self.close)
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                self._previous[sig] = signal.signal(sig, self._on_signal)

    # -- lifetime ---------------------------------------------------------

    def __enter__(self) -> "Lab":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _on_signal(self, signum, frame) -> None:
        self.close()
        raise SystemExit(128 + signum)

    def _remove_stale(self) -> None:
        """Deletes namespaces of earlier labs (same prefix) whose process is gone."""
        out = _run(["ip", "netns", "list"])
        for line in out.splitlines():
            name = line.split()[0] if line.split() else ""
            if not name.startswith(self.prefix) or "-" not in name:
                continue
            pid = name[len(self.prefix) : name.index("-")]
            if pid.isdigit() and not _pid_alive(int(pid)):
                for p in _run(["ip", "netns", "pids", name]).split():
                    # Processes of a dead lab still inside its namespace.
                    try:
                        os.kill(int(p), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)

    def stop(self, p: subprocess.Popen) -> None:
        """Stops one of this lab's processes (SIGTERM, then SIGKILL)."""
        if p.poll() is None:
            try:
                p.terminate()
                p.wait(timeout=self.grace)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=30)
        if p in self.procs:
            self.procs.remove(p)

    def close(self) -> None:
        """Stops every process, deletes every namespace (idempotent)."""
        if self._closed:
            return
        self._closed = True
        errors = []
        for p in list(self.procs):
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + self.grace
        for p in list(self.procs):
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    errors.append(f"process {p.pid} did not exit after SIGKILL")
        self.procs.clear()
        for ns in reversed(self.namespaces):
            # Anything still inside (a grandchild a process left behind).
            try:
                for pid in _run(["ip", "netns", "pids", ns]).split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            except NetlabError:
                pass
            r = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True, timeout=30)
            if r.returncode != 0 and "No such file" not in r.stderr:
                errors.append(f"ip netns del {ns}: {r.stderr.strip()}")
        self.namespaces.clear()
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        if errors:
            print("netlab: cleanup: " + "; ".join(errors), file=sys.stderr)

    # -- topology ---------------------------------------------------------

    def namespace(self, name: str) -> str:
        """Creates a namespace (loopback up); returns its full name."""
        if not name.replace("_", "").isalnum():
            raise NetlabError(f"namespace name `{name}`: letters, digits and _ only")
        full = f"{self._tag}-{name}"
        _run(["ip", "netns", "add", full])
        self.namespaces.append(full)
        _run(["ip", "-n", full, "link", "set", "lo", "up"])
        return full

    def link(
        self,
        ns_a: str | None,
        ns_b: str,
        rate_mbit: float | None = None,
        burst: str = "512kb",
        latency: str = "50ms",
    ) -> Link:
        """Joins two namespaces with a veth pair on a /30 (a end .1, b end .2),
        shaped at `rate_mbit` (megabits per second, 800 = 100 MB/s) at both
        ends when given. `ns_a` may be `HOST`: the machine's own namespace
        (its end is named after this lab's process, and goes when `ns_b` is
        deleted)."""
        i = len(self.links) + 1
        if i > 250:
            raise NetlabError("at most 250 links per lab")
        if_a = f"h{os.getpid()}x{i}" if ns_a is HOST else f"l{i}a"
        if_b = f"l{i}b"
        where_a = [] if ns_a is HOST else ["netns", ns_a]
        _run(["ip", "link", "add", if_a, *where_a, "type", "veth", "peer", "name", if_b, "netns", ns_b])
        addr_a, addr_b = f"10.{self.net}.{i}.1", f"10.{self.net}.{i}.2"
        for ns, dev, addr in ((ns_a, if_a, addr_a), (ns_b, if_b, addr_b)):
            _run([*_in(ns, "ip"), "addr", "add", f"{addr}/30", "dev", dev])
            _run([*_in(ns, "ip"), "link", "set", dev, "up"])
            if rate_mbit is not None:
                self.shape(ns, dev, rate_mbit, burst, latency)
        link = Link(self, ns_a, ns_b, if_a, if_b, addr_a, addr_b)
        self.links.append(link)
        return link

    def shape(self, ns: str | None, dev: str, rate_mbit: float, burst: str = "512kb", latency: str = "50ms") -> None:
        """Limits what leaves `dev` to `rate_mbit` with a token bucket filter."""
        _run(
            [*_in(ns, "tc"), "qdisc", "replace", "dev", dev, "root", "tbf",
             "rate", f"{rate_mbit:g}mbit", "burst", burst, "latency", latency]
        )

    def tx_bytes(self, ns: str | None, dev: str) -> int:
        out = json.loads(_run([*_in(ns, "ip"), "-s", "-j", "link", "show", "dev", dev]))
        return int(out[0]["stats64"]["tx"]["bytes"])

    # -- processes --------------------------------------------------------

    def spawn(
        self,
        ns: str,
        argv: list[str],
        env: dict[str, str] | None = None,
        log: str | Path | None = None,
        stdout=None,
        stdin=None,
        cwd: str | Path | None = None,
    ) -> subprocess.Popen:
        """Starts `argv` inside `ns`. stderr (and stdout unless `stdout` is
        given, e.g. subprocess.PIPE) go to `log` when given."""
        logf = open(log, "ab") if log is not None else subprocess.DEVNULL
        try:
            p = subprocess.Popen(
                ["ip", "netns", "exec", ns, *argv],
                env=env,
                stdout=stdout if stdout is not None else logf,
                stderr=logf,
                stdin=stdin if stdin is not None else subprocess.DEVNULL,
                cwd=cwd,
                preexec_fn=die_with_parent,
            )
        finally:
            if log is not None:
                logf.close()
        self.procs.append(p)
        return p

    def run(self, ns: str, argv: list[str], timeout: float = 120.0, env: dict[str, str] | None = None) -> str:
        """Runs `argv` inside `ns` to completion; returns its stdout."""
        return _run(argv, timeout, env, ns)

    def wait_http(self, ns: str, url: str, timeout: float = 60.0, proc: subprocess.Popen | None = None) -> None:
        """Waits until `url` answers any HTTP status from inside `ns` (and
        `proc`, when given, is still running)."""
        code = (
            "import sys,time,urllib.request,urllib.error\n"
            "end=time.monotonic()+float(sys.argv[2])\n"
            "while time.monotonic()<end:\n"
            "    try:\n"
            "        urllib.request.urlopen(sys.argv[1],timeout=2).read(); sys.exit(0)\n"
            "    except urllib.error.HTTPError: sys.exit(0)\n"
            "    except Exception: time.sleep(0.1)\n"
            "sys.exit(1)\n"
        )
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            if proc is not None and proc.poll() is not None:
                raise NetlabError(f"{' '.join(map(str, proc.args[3:]))} exited ({proc.returncode}) before {url} answered")
            r = subprocess.run(
                ["ip", "netns", "exec", ns, sys.executable, "-c", code, url, str(min(left, 2.0))],
                capture_output=True, timeout=left + 30,
            )
            if r.returncode == 0:
                return
            if time.monotonic() >= end:
                raise NetlabError(f"in {ns}: {url} did not answer within {timeout} s")

    def tool(self, ns: str, args: list[str], **kw) -> subprocess.Popen:
        """Starts one of this file's command-line tools inside `ns`."""
        return self.spawn(ns, [sys.executable, str(Path(__file__).resolve()), *args], **kw)


# -- tools run inside a namespace ---------------------------------------------


def _lifetime(max_seconds: float) -> None:
    """Ends this process after `max_seconds` whatever it is doing."""
    if max_seconds > 0:
        signal.signal(signal.SIGALRM, lambda *_: os._exit(3))
        signal.alarm(max(1, int(max_seconds)))


def moto_main(host: str, port: int) -> None:
    """moto's server, ranged GETs served from the object's spool file."""
    from moto.s3 import models, responses

    local = threading.local()

    class Window:
        """An object's bytes, read only where sliced."""

        def __init__(self, key):
            self.key = key

        def __len__(self) -> int:
            return self.key.contentsize

        def __bool__(self) -> bool:
            return self.key.contentsize > 0

        def __getitem__(self, s):
            start, stop, _ = s.indices(self.key.contentsize)
            with self.key.lock:
                self.key._value_buffer.seek(start)
                return self.key._value_buffer.read(max(0, stop - start))

    value = models.FakeKey.value

    def lazy_value(self):
        return Window(self) if getattr(local, "lazy", False) else value.fget(self)

    def simple_range(header: str) -> bool:
        unit, _, spec = header.partition("=")
        if unit.strip() != "bytes" or "," in spec:
            return False
        a, sep, b = spec.strip().partition("-")
        if not sep or not (a + b).isdigit():
            return False
        return not (a and b) or int(b) >= int(a)

    get_object = responses.S3Response.get_object

    def ranged_get_object(self):
        lazy = simple_range(self.headers.get("range") or "") and not self.querystring.get("partNumber")
        local.lazy = lazy
        try:
            return get_object(self)
        finally:
            local.lazy = False

    responses.S3Response.get_object = ranged_get_object

    key_response = responses.S3Response.key_response

    def whole_if_unsliced(self, request, full_url, headers):
        status, hdrs, body = key_response(self, request, full_url, headers)
        if isinstance(body, Window):  # a path that did not slice it
            body = body[:]
        return status, hdrs, body

    responses.S3Response.key_response = whole_if_unsliced

    # CompleteMultipartUpload: stock moto joins the parts in memory several
    # times over (the object, a copy for its checksum, bytes() of both: about
    # 4x the object). Here the parts are copied, one 16 MiB block at a time,
    # into a spool file that becomes the new object's (moto disposes of the
    # parts before it creates the object), and the checksum moto records by
    # default (CRC64NVME, or CRC32 without awscrt) is computed on the way.
    # Uploads that ask for a checksum algorithm keep moto's own code.
    import tempfile

    class Joined:
        def __init__(self, parts):
            self.spool = tempfile.SpooledTemporaryFile(models.get_s3_default_key_buffer_size())
            self.size = 0
            self.crc, self.crc_bytes = 0, 4
            try:
                from awscrt import checksums

                update, self.crc_bytes = checksums.crc64nvme, 8
            except ImportError:
                import binascii

                update = binascii.crc32
            for p in parts:
                with p.lock:
                    p._value_buffer.seek(0)
                    while True:
                        b = p._value_buffer.read(16 << 20)
                        if not b:
                            break
                        self.spool.write(b)
                        self.crc = update(b, self.crc)
                        self.size += len(b)

        def __len__(self) -> int:
            return self.size

    def set_value(self, new_value):
        if not isinstance(new_value, Joined):
            return value.fset(self, new_value)
        self._value_buffer.close()
        self._value_buffer = new_value.spool
        self.contentsize = new_value.size

    models.FakeKey.value = property(lazy_value, set_value)

    complete = models.FakeMultipart.complete

    def streaming_complete(self, body):
        if self.metadata.get("x-amz-checksum-algorithm") or self.metadata.get("x-amz-checksum-type"):
            return complete(self, body)
        import base64
        import codecs

        decode_hex = codecs.getdecoder("hex_codec")
        md5s, parts, last = bytearray(), [], None
        for pn, etag in body:
            part = self.parts.get(pn)
            if part is None or part.etag.replace('"', "") != etag.replace('"', ""):
                raise models.InvalidPart()
            if last is not None and last.contentsize < models.S3_UPLOAD_PART_MIN_SIZE:
                raise models.EntityTooSmall()
            md5s.extend(decode_hex(part.etag.replace('"', ""))[0])
            parts.append(part)
            last = part
        if not parts:
            raise models.MalformedXML
        joined = Joined(parts)
        digest = joined.crc.to_bytes(joined.crc_bytes, "big")
        full_etag = models.md5_hash()
        full_etag.update(bytes(md5s))
        checksum = ("FULL_OBJECT", base64.b64encode(digest).decode(), 1)
        return joined, f"{full_etag.hexdigest()}-{len(parts)}", checksum

    models.FakeMultipart.complete = streaming_complete

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from moto_server import make_conditional_writes_atomic

    make_conditional_writes_atomic()
    from moto.server import main

    main(["-H", host, "-p", str(port)])


class _Reader:
    """A socket with a read buffer: HTTP heads, exact lengths, chunked bodies."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = bytearray()

    def fill(self) -> bool:
        data = self.sock.recv(1 << 20)
        if not data:
            return False
        self.buf += data
        return True

    def head(self) -> bytes | None:
        """The next message head (through the blank line); None at a clean EOF."""
        while True:
            i = self.buf.find(b"\r\n\r\n")
            if i >= 0:
                head = bytes(self.buf[: i + 4])
                del self.buf[: i + 4]
                return head
            if len(self.buf) > 1 << 16:
                raise ValueError("HTTP head over 64 KiB")
            if not self.fill():
                if self.buf:
                    raise ValueError("connection closed inside an HTTP head")
                return None

    def line(self) -> bytes:
        while True:
            i = self.buf.find(b"\r\n")
            if i >= 0:
                line = bytes(self.buf[: i + 2])
                del self.buf[: i + 2]
                return line
            if len(self.buf) > 1 << 16 or not self.fill():
                raise ValueError("bad chunked framing")

    def copy(self, dst: socket.socket, n: int, view: memoryview) -> None:
        """Forwards exactly n bytes."""
        if self.buf:
            k = min(n, len(self.buf))
            dst.sendall(self.buf[:k])
            del self.buf[:k]
            n -= k
        while n > 0:
            k = self.sock.recv_into(view, min(n, len(view)))
            if k == 0:
                raise ValueError("connection closed inside a body")
            dst.sendall(view[:k])
            n -= k

    def copy_chunked(self, dst: socket.socket, view: memoryview) -> None:
        while True:
            line = self.line()
            dst.sendall(line)
            size = int(line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while True:  # trailers, then the blank line
                    t = self.line()
                    dst.sendall(t)
                    if t == b"\r\n":
                        return
            self.copy(dst, size + 2, view)

    def copy_to_eof(self, dst: socket.socket, view: memoryview) -> None:
        if self.buf:
            dst.sendall(self.buf)
            self.buf.clear()
        while True:
            k = self.sock.recv_into(view)
            if k == 0:
                return
            dst.sendall(view[:k])


def _headers(head: bytes) -> tuple[str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    fields = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            fields[k.strip().lower()] = v.strip()
    return lines[0], fields


def _body_kind(fields: dict[str, str]) -> tuple[str, int]:
    if "chunked" in fields.get("transfer-encoding", "").lower():
        return "chunked", 0
    if "content-length" in fields:
        return "length", int(fields["content-length"])
    return "none", 0


def _split_addr(s: str) -> tuple[str, int]:
    host, _, port = s.rpartition(":")
    if not host or not port.isdigit():
        raise SystemExit(f"address `{s}`: expected HOST:PORT")
    return host, int(port)


def router_main(listen: str, routes: dict[str, tuple[str, int]], default: tuple[str, int]) -> None:
    """Forwards each HTTP/1.1 request to the server of its first path segment."""

    def serve(client: socket.socket) -> None:
        view = memoryview(bytearray(1 << 20))
        upstreams: dict[tuple[str, int], _Reader] = {}
        reader = _Reader(client)
        try:
            while True:
                head = reader.head()
                if head is None:
                    return
                request_line, fields = _headers(head)
                method, target = request_line.split(" ")[:2]
                path = urllib.parse.urlsplit(target).path
                bucket = path.lstrip("/").split("/", 1)[0]
                backend = routes.get(bucket, default)
                up = upstreams.get(backend)
                if up is not None:
                    # A kept-alive upstream the server closed since: reconnect.
                    up.sock.setblocking(False)
                    try:
                        closed = up.sock.recv(1, socket.MSG_PEEK) == b""
                    except BlockingIOError:
                        closed = False
                    except OSError:
                        closed = True
                    up.sock.setblocking(True)
                    if closed:
                        up.sock.close()
                        up = None
                if up is None:
                    s = socket.create_connection(backend, timeout=600)
                    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    up = upstreams[backend] = _Reader(s)
                up.sock.sendall(head)
                kind, n = _body_kind(fields)
                if kind == "length":
                    reader.copy(up.sock, n, view)
                elif kind == "chunked":
                    reader.copy_chunked(up.sock, view)
                while True:
                    rhead = up.head()
                    if rhead is None:
                        raise ValueError(f"{backend} closed the connection without answering")
                    status_line, rfields = _headers(rhead)
                    client.sendall(rhead)
                    status = int(status_line.split(" ")[1])
                    if status != 100 and 100 <= status < 200:
                        continue
                    if status != 100:
                        break
                    # 100 Continue: the final answer follows.
                rkind, rn = _body_kind(rfields)
                if method == "HEAD" or status in (204, 304):
                    pass
                elif rkind == "length":
                    up.copy(client, rn, view)
                elif rkind == "chunked":
                    up.copy_chunked(client, view)
                else:
                    up.copy_to_eof(client, view)
                    return
                if rfields.get("connection", "").lower() == "close" or fields.get("connection", "").lower() == "close":
                    return
        except (OSError, ValueError) as e:
            print(f"s3-router: {e}", file=sys.stderr, flush=True)
        finally:
            client.close()
            for u in upstreams.values():
                u.sock.close()

    host, port = _split_addr(listen)
    srv = socket.create_server((host, port), backlog=256)
    while True:
        c, _ = srv.accept()
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=serve, args=(c,), daemon=True).start()


def watch_main(urls: list[str], fld: str, interval: float) -> None:
    """Prints {"t", "url", field} whenever the field of a URL's JSON changes."""
    last: dict[str, object] = {}
    while True:
        for url in urls:
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    value = json.load(r).get(fld)
            except Exception:
                continue
            if url not in last or last[url] != value:
                last[url] = value
                print(json.dumps({"t": time.monotonic(), "url": url, fld: value}), flush=True)
        time.sleep(interval)


def http_get_main(url: str) -> None:
    start = time.monotonic()
    n = 0
    with urllib.request.urlopen(url, timeout=600) as r:
        while True:
            b = r.read(1 << 20)
            if not b:
                break
            n += len(b)
    print(json.dumps({"bytes": n, "seconds": time.monotonic() - start}), flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-seconds", type=float, default=6 * 3600, help="lifetime bound (s)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("moto", help="moto's S3 server with ranged GETs read from the spool")
    m.add_argument("host")
    m.add_argument("port", type=int)
    r = sub.add_parser("s3-router", help="forward requests by bucket (first path segment)")
    r.add_argument("--listen", required=True, metavar="HOST:PORT")
    r.add_argument("--route", action="append", default=[], metavar="BUCKET=HOST:PORT")
    r.add_argument("--default", required=True, metavar="HOST:PORT")
    w = sub.add_parser("watch", help="print changes of a field of JSON endpoints")
    w.add_argument("urls", nargs="+")
    w.add_argument("--field", default="version")
    w.add_argument("--interval", type=float, default=0.05)
    g = sub.add_parser("http-get", help="GET a URL, print bytes and seconds")
    g.add_argument("url")
    a = ap.parse_args(argv)
    _lifetime(a.max_seconds)
    if a.cmd == "moto":
        moto_main(a.host, a.port)
    elif a.cmd == "s3-router":
        routes = {}
        for spec in a.route:
            bucket, sep, addr = spec.partition("=")
            if not sep or not bucket:
                raise SystemExit(f"--route `{spec}`: expected BUCKET=HOST:PORT")
            routes[bucket] = _split_addr(addr)
        router_main(a.listen, routes, _split_addr(a.default))
    elif a.cmd == "watch":
        watch_main(a.urls, a.field, a.interval)
    elif a.cmd == "http-get":
        http_get_main(a.url)


if __name__ == "__main__":
    main()
