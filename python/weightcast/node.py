"""One download per node, every rank patched in place, one version everywhere.

A tensor-parallel engine runs T worker processes on a node. Following a
bucket from each of them costs T downloads and T host copies of the model
per version, and lets ranks drift apart. Here one subscriber per node — the
:class:`NodeFollower`, in one elected rank (or a sidecar) — downloads and
verifies each version once and keeps the node's single host copy of the
checkpoint in shared memory (``/dev/shm``); every rank's
:class:`RankFollower` patches its own parameters from it, and
:class:`TensorParallelFollower` makes them change version together:

1. the node polls the bucket (it alone: no worker touches the store). A
   delta's changed elements are resolved against the host copy (the
   library's O(changed) verification of the base) and written, once for
   the node, as one patch in checkpoint coordinates (positions, old words,
   new words: about twice the delta). An anchor is written into the host
   copy (verified by its digests); a rank then loads its shard from there;
2. every rank **prepares**: it maps the patch's positions to its own
   parameters (:class:`weightcast.shard.Mapping`, probed from the
   engine's loaders at start-up; fused, sharded and padded parameters
   alike), checks that each element it will write holds the patch's old
   value (O(changed) per rank, exact), and stages the new values. Nothing
   is written;
3. the ranks vote (``torch.distributed``, any backend: gloo on CPU). Only
   when every rank prepared does every rank **commit** (one scatter per
   parameter) — and the node its host copy. A rank that failed, or did not
   answer within the timeout, leaves every rank on the previous version;
   the failure is reported, and the next step repairs that rank from the
   node's host copy (its shard reloaded: no download).

Memory on the node: one host copy of the model plus the patch (about twice
the delta); per rank, its staged changes. The hand-off files carry their
version and checksums (the index's SHA-256, handed to every rank; in it, the
BLAKE3 of each 8 MiB stripe of the patch): files removed or changed under
the follower are detected and rebuilt, never read stale. The ranks split
that check: rank r hashes stripes r, r + T, ..., and no rank commits
unless every rank's stripes matched (the vote of step 3). A host copy
removed or replaced under the node is rebuilt from the bucket (its newest
version, as an anchor), and every rank loads its shard from the new copy.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import hashlib
import json
import logging
import os
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from . import Subscriber, Update, _device, _native
from ._errors import BadRequest, BaseMismatch, Corrupt, Error, Unavailable
from ._tensors import _DTYPE_BYTES, _WORDS_NUMPY, Raw
from .shard import Mapping as ShardMap
from .shard import Unmappable, copy_runs, probe

logger = logging.getLogger("weightcast.node")

#: Bytes per stripe of a patch, each with its own BLAKE3 in the index: the
#: unit in which the ranks split the hand-off's check.
STRIPE = 8 << 20

Spec = Tuple[str, List[int]]  # (safetensors dtype, shape)


def _torch():
    import torch

    return torch


def _words(dtype: str) -> Any:
    return _WORDS_NUMPY[_DTYPE_BYTES[dtype]]


def _stripes(path: Path, stripe: int, indices: Sequence[int]) -> List[str]:
    """The BLAKE3 of those stripes of a file (the library's, in parallel)."""
    return list(_native.file_blake3_stripes(str(path), stripe, list(indices)))


def _read_patch(h: "Handoff", rank: int = 0, world: int = 1) -> Optional[Dict[str, Any]]:
    """The index of the hand-off ``h`` when its files are the node's: the
    index by its checksum (read once), the patch by its size and by the
    BLAKE3 of stripes ``rank, rank + world, ...``; None when anything is
    missing or differs."""
    meta = _patch_index(h)
    if meta is None or not _stripes_match(h, meta, rank, world):
        return None
    return meta


def _patch_index(h: "Handoff") -> Optional[Dict[str, Any]]:
    """:func:`_read_patch` without the stripes' check: the index by its
    checksum, the patch's size and every entry's ranges within it."""
    vdir = Path(h.patch or "")
    try:
        raw = (vdir / "patch.json").read_bytes()
        if hashlib.sha256(raw).hexdigest() != h.checksum:
            return None
        meta = json.loads(raw)
        size, stripe, digests = int(meta["size"]), int(meta["stripe"]), list(meta["stripes"])
        if (meta["version"] != h.version or stripe <= 0 or len(digests) != -(-size // stripe)
                or (vdir / "patch.bin").stat().st_size != size
                or not all(_fits(e, size) for e in meta["tensors"].values())):
            return None
        return dict(meta)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, Error):
        return None


def _stripes_match(h: "Handoff", meta: Mapping[str, Any], rank: int, world: int) -> bool:
    """Whether stripes ``rank, rank + world, ...`` of ``h``'s patch hash to
    what ``meta`` (its checked index) says."""
    try:
        digests = list(meta["stripes"])
        mine = range(rank, len(digests), world)
        return (_stripes(Path(h.patch or "") / "patch.bin", int(meta["stripe"]), mine)
                == [digests[i] for i in mine])
    except (OSError, ValueError, KeyError, TypeError, AttributeError, Error):
        return False


def _fits(e: Mapping[str, Any], size: int) -> bool:
    """Whether an index entry's positions, old and new words lie within a
    patch of ``size`` bytes (the ranks and the node then lend those ranges
    to the library by address)."""
    n, pw, wb = e["n"], e.get("pw", 8), e["wb"]
    if not all(type(v) is int and v >= 0 for v in (n, pw, wb, e["pos"], e["old"], e["new"])):
        return False
    return (pw in (4, 8) and wb in (1, 2, 4, 8) and e["pos"] + n * pw <= size
            and e["old"] + n * wb <= size and e["new"] + n * wb <= size)


class HostState:
    """The node's one copy of the checkpoint's tensors: a raw file of their
    words in shared memory and its index (name → dtype, shape, offset),
    mapped writable by the node and read-only by the ranks."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.data = self.root / "state.bin"
        self.index_path = self.root / "state.json"
        # (the file's identity when mapped, the arrays): see `mapped`
        self._held: Optional[Tuple[Tuple[int, int, int], Dict[str, np.ndarray]]] = None

    def create(self, specs: Mapping[str, Spec]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        index, off = {}, 0
        for name, (dtype, shape) in specs.items():
            n = int(np.prod(shape, dtype=np.int64)) * _DTYPE_BYTES[dtype]
            index[name] = [dtype, list(shape), off]
            off += (n + 63) // 64 * 64
        with open(self.data, "wb") as f:
            f.truncate(max(off, 1))
        self.index_path.write_text(json.dumps(index))

    def mapped(self) -> Dict[str, np.ndarray]:
        """:meth:`arrays` (writable), kept mapped from one call to the next
        while the file is the same one: a fresh map of a large host copy
        costs a page fault per page the next version touches. Mapped again
        when the file was replaced or resized."""
        identity = _identity(self.data)
        if self._held is None or self._held[0] != identity:
            self._held = (identity, self.arrays(writable=True))
        return self._held[1]

    def replaced(self) -> bool:
        """Whether the file is no longer the one :meth:`mapped` holds
        (removed, or another in its place); False before the first map."""
        if self._held is None:
            return not self.data.exists()
        try:
            return self._held[0] != _identity(self.data)
        except OSError:
            return True

    def index(self) -> Dict[str, Tuple[str, List[int], int]]:
        return {k: (v[0], v[1], v[2]) for k, v in json.loads(self.index_path.read_text()).items()}

    def specs(self) -> Dict[str, Spec]:
        return {k: (v[0], v[1]) for k, v in self.index().items()}

    def arrays(self, writable: bool) -> Dict[str, np.ndarray]:
        """Each tensor's words (flat), over the shared file."""
        mm = np.memmap(self.data, dtype=np.uint8, mode="r+" if writable else "r")
        out = {}
        for name, (dtype, shape, off) in self.index().items():
            w = _words(dtype)
            n = int(np.prod(shape, dtype=np.int64))
            out[name] = mm[off: off + n * np.dtype(w).itemsize].view(w)
        return out


def _identity(path: Path) -> Tuple[int, int, int]:
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size)


@dataclass
class Handoff:
    """What every rank does for one step: ``load`` (its whole shard from
    the host copy, at ``version``) or ``patch`` (``base`` → ``version``
    from the patch file)."""

    op: str
    version: int
    base: Optional[int] = None
    patch: Optional[str] = None
    checksum: Optional[str] = None


class NodeFollower:
    """The node's subscriber: the only reader of the bucket on the node
    (see the module). ``root`` is node-local shared memory."""

    def __init__(self, store_url: str, root: Path, **subscriber_options: Any) -> None:
        self.root = Path(root)
        self.host = HostState(self.root)
        self.subscriber = Subscriber(store_url, **subscriber_options)
        self.update: Optional[Update] = None
        # A hand-off some rank could not prepare: tried again, not downloaded again.
        self.pending: Optional[Handoff] = None
        # Per version: (downloads, bytes) — one download per version per node.
        self.downloaded: Dict[int, Tuple[int, int]] = {}
        #: Where the last delta's node work went: ``fetch_s`` (download and
        #: verify), ``resolve_s`` (decoded, old words gathered from the host
        #: copy and checked, the patch written), ``write_s`` (its index and
        #: checksums).
        self.phases: Dict[str, float] = {}

    @property
    def version(self) -> Optional[int]:
        """The version the node's host copy holds."""
        return self.subscriber.version

    def next(self, timeout: float = 0.0) -> Optional[Handoff]:
        """The next version's hand-off, or None when nothing is new. A
        version some rank could not prepare is offered again (its hand-off
        rewritten if it vanished), not downloaded again. A host copy that
        vanished is rebuilt first (see :meth:`load_handoff`)."""
        if self._host_gone():
            return self._rebuild()
        if self.pending is not None:
            h = self.pending
            if _read_patch(h) is None:
                assert self.update is not None
                h = self._patch(self.update)
            return h
        t0 = time.perf_counter()
        u = self.subscriber.poll() if timeout == 0 else self.subscriber.wait(timeout)
        self.phases = {"fetch_s": time.perf_counter() - t0}
        if u is None:
            return None
        if u.kind == "anchor":
            return self._anchor(u)
        self._count(u)
        self.update = u
        return self._patch(u)

    def _count(self, u: Update) -> None:
        n, b = self.downloaded.get(u.version, (0, 0))
        self.downloaded[u.version] = (n + 1, b + u.nbytes)

    def _anchor(self, u: Update) -> Handoff:
        """Writes an anchor into the host copy (created anew when missing or
        of another layout); every rank then loads its shard from there."""
        self._count(u)
        specs = {n: (d, list(s)) for n, d, s in u._native.tensors()}
        if (not self.host.index_path.exists() or not self.host.data.exists()
                or self.host.specs() != specs):
            self.host.create(specs)
        arrays = self.host.mapped()
        u.apply_to({n: Raw(arrays[n], d, tuple(s)) for n, (d, s) in specs.items()})
        arrays = None
        return Handoff("load", u.version)

    def _host_gone(self) -> bool:
        """Whether the host copy of the version the node holds is missing,
        or is not the file the node wrote (shared memory cleaned up, or
        replaced, under it)."""
        if self.version is None:
            return False
        try:
            self.host.specs()
        except (OSError, ValueError):
            return True
        return self.host.replaced()

    def _rebuild(self) -> Handoff:
        """The host copy is gone: nothing is read from it; the node takes
        the bucket's newest version as an anchor (one more download, for
        the repair) and every rank loads its shard from the new copy."""
        logger.warning("node follower: the host copy in %s is gone or replaced (shared memory "
                       "cleaned up?): rebuilding it from the bucket's newest anchor", self.root)
        self.pending, self.update = None, None
        u = self.subscriber.poll(anchor=True)
        if u is None or u.kind != "anchor":
            raise Unavailable(f"the node's host copy in {self.root} is gone and the bucket "
                              "offered no anchor to rebuild it from; the next step tries again")
        return self._anchor(u)

    def load_handoff(self) -> Handoff:
        """Every rank loads its shard from the host copy (an anchor, or a
        repair). A host copy that vanished is rebuilt from the bucket first,
        never read stale."""
        if self.version is None:
            raise BadRequest("the node holds no version yet")
        if self._host_gone():
            return self._rebuild()
        return Handoff("load", self.version)

    def _patch(self, u: Update) -> Handoff:
        """Resolves a delta against the host copy (verified, O(changed)) and
        writes the node's one patch: per changed tensor, positions (32-bit
        where they fit), old and new words. The library decodes the changes
        and writes the positions straight into the patch, gathers the old
        words there from the host copy and, once every tensor's old words
        matched the delta's base, writes the new words there: every step in
        parallel, none in Python per element."""
        t0 = time.perf_counter()
        plan, pos_bytes, word_bytes = u._native.device_changes()
        sub = {"decode_s": time.perf_counter() - t0}
        vdir = self.root / f"v{u.version}"
        shutil.rmtree(vdir, ignore_errors=True)
        vdir.mkdir(parents=True)
        blob = vdir / "patch.bin"
        # [positions | old words | new words], each tensor's part at a
        # multiple of 8 bytes: the ranks view them as words in place.
        size = pos_bytes + 2 * word_bytes
        with open(blob, "wb") as f:
            f.truncate(size)
        index = {}
        if size:
            mm = np.memmap(blob, dtype=np.uint8, mode="r+", shape=(size,))
            at = mm.ctypes.data
            t = time.perf_counter()
            u._native.device_positions(at, pos_bytes)
            arrays = self.host.mapped()
            sub["positions_s"] = time.perf_counter() - t
            t = time.perf_counter()
            _native.gather_words([
                (name, arrays[name].ctypes.data, arrays[name].nbytes, at + po, n, pw, wb,
                 at + pos_bytes + wo) for name, n, pw, wb, po, wo in plan])
            sub["gather_s"] = time.perf_counter() - t
            t = time.perf_counter()
            u._native.device_resolve((at + pos_bytes, word_bytes),
                                     (at + pos_bytes + word_bytes, word_bytes))
            sub["verify_s"] = time.perf_counter() - t
            del mm, arrays
        for name, n, pw, wb, po, wo in plan:
            index[name] = {"n": n, "wb": wb, "pw": pw, "pos": po, "old": pos_bytes + wo,
                           "new": pos_bytes + word_bytes + wo}
        t1 = time.perf_counter()
        meta = {"version": u.version, "base": u.base_version, "tensors": index, "size": size,
                "stripe": STRIPE, "stripes": _stripes(blob, STRIPE, range(-(-size // STRIPE)))}
        raw = json.dumps(meta).encode()
        (vdir / "patch.json").write_bytes(raw)
        self.phases.update(resolve_s=t1 - t0, write_s=time.perf_counter() - t1, **sub)
        self.pending = Handoff("patch", u.version, u.base_version, str(vdir),
                               hashlib.sha256(raw).hexdigest())
        return self.pending

    def commit(self, h: Handoff) -> None:
        """Every rank committed: the host copy moves too (the patch's new
        words scattered into it, the version recorded as applied). A patch
        that is no longer the node's is rebuilt first (from the update,
        which is still held)."""
        if h.op == "patch":
            assert self.update is not None
            if self._host_gone():
                # Nothing to write into: the next step rebuilds the host copy
                # from the bucket, and every rank reloads from it.
                logger.warning("node follower: the host copy in %s vanished while version %s "
                               "was committed; it is rebuilt at the next step", self.root,
                               h.version)
                self.pending = None
                self._drop(h)
                return
            meta = _read_patch(h)
            if meta is None:
                h = self._patch(self.update)
                meta = _read_patch(h)
                if meta is None:
                    raise Corrupt(f"the hand-off of version {h.version} in {h.patch} changed "
                                  "while it was rebuilt")
            self.pending = None
            blob = np.memmap(Path(h.patch or "") / "patch.bin", dtype=np.uint8, mode="r") \
                if meta["size"] else np.zeros(0, np.uint8)
            arrays = self.host.mapped()
            at = blob.ctypes.data
            _native.scatter_words([
                (name, arrays[name].ctypes.data, arrays[name].nbytes, at + e["pos"], e["n"],
                 e["pw"], e["wb"], at + e["new"]) for name, e in meta["tensors"].items()])
            arrays = blob = None
            self.update._native.commit_resolved()
            self._drop(h)

    def abort(self, h: Handoff) -> None:
        """Some rank did not prepare: nothing moves (the host copy stays at
        its version); a patch is kept for the next step to try again."""
        if h.op != "patch":
            return

    def _drop(self, h: Handoff) -> None:
        self.update = None
        if h.patch:
            shutil.rmtree(h.patch, ignore_errors=True)


class RankFollower:
    """One rank's side: its parameters, their map from checkpoint
    coordinates, and the change it has prepared. ``rank`` of ``world``
    picks the stripes of each hand-off this rank checks (all by default)."""

    def __init__(self, params: Mapping[str, Any], mapping: ShardMap, root: Path,
                 rank: int = 0, world: int = 1) -> None:
        self.params = dict(params)
        self.rank, self.world = rank, world
        self.mapping = mapping
        self.host = HostState(Path(root))
        self.version: Optional[int] = None
        self._memory = {n: (t.data_ptr(), t.numel()) for n, t in self.params.items()}
        self._fingerprint = mapping.fingerprint()
        self._staged: Optional[Tuple[Handoff, List[Tuple[Any, Any, Any]]]] = None
        self.commit_seconds = 0.0
        self._staging = _device.Staging()
        # Hashes this rank's stripes of a patch while its bytes travel (the
        # library lets go of the GIL).
        self._checker = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="weightcast-check")
        #: Where the last patch's prepare went: ``check_s`` (the hand-off's
        #: index, and where this rank's changes lie in the patch),
        #: ``upload_s`` (those bytes to the device), ``check_wait_s``
        #: (waiting for this rank's stripes of the patch to be hashed, on a
        #: thread since the index was read), ``apply_s`` (positions mapped,
        #: old words checked, new words picked).
        self.prepare_phases: Dict[str, float] = {}
        #: Bytes of the last patch this rank needs where its parameters are
        #: (moved there on a GPU; read in place on the CPU).
        self.upload_bytes = 0

    def _words(self, name: str) -> Any:
        from ._tensors import word_view

        t = self.params[name]
        return word_view(name, t, t.element_size())

    def _check_memory(self) -> None:
        for n, t in self.params.items():
            if (t.data_ptr(), t.numel()) != self._memory[n]:
                raise BadRequest(f"parameter `{n}` moved since start-up (reallocated): the "
                                 "mapping no longer holds; restart the follower")

    def prepare(self, h: Handoff) -> None:
        """Verifies and stages ``h`` for this rank's parameters, writing
        nothing; raises (naming the parameter) when it cannot."""
        torch = _torch()
        self._staged = None
        self._check_memory()
        if h.op == "load":
            staged = self._stage_load()
        else:
            if self.version != h.base:
                raise BaseMismatch(f"this rank holds version {self.version}, the patch is from "
                                   f"{h.base}")
            staged = self._stage_patch(h)
        self._staged = (h, staged)
        logger.debug("rank prepared %s version %s: %d writes", h.op, h.version,
                     sum(int(s[2].numel()) for s in staged))
        _ = torch

    def _stage_load(self) -> List[Tuple[Any, Any, Any]]:
        """A load checks that the host copy holds every tensor this rank
        needs. On a GPU with room for a second copy of this rank's
        parameters it also builds the new values there, from the host copy,
        while the engine serves: the commit is then one device copy per
        parameter. Otherwise the commit copies the shard in from the host
        (the pause is one copy of the shard, as a reload's)."""
        index = self.host.index()
        for cname in self.mapping.tensors:
            if cname not in index:
                raise BaseMismatch(f"checkpoint tensor `{cname}`, which this rank's parameters "
                                   "hold, is not in the node's version")
        if any(t.device.type == "cuda" for t in self.params.values()):
            # The pinned ring the patches travel through, pinned now, while
            # the engine serves (on an H200 the first delta's upload, which
            # pinned it, took 0.13-0.19 s; the next ones about 0.02 s).
            for k in range(_device.ANCHOR_RING):
                self._staging.get(("anchor", k), _device.ANCHOR_CHUNK, True)
        if not self._room_on_device():
            return []
        # Every parameter this rank loads, as it is now (elements no run
        # covers, e.g. a vocabulary shard's padding, keep their values) ...
        names = {r.param for runs in self.mapping.tensors.values() for r in runs}
        fresh = {n: self._words(n).clone() for n in names}
        # ... then the checkpoint's elements over it, from the host copy.
        self._load(into=fresh)
        return [(self._words(n), None, w) for n, w in fresh.items()]

    def _room_on_device(self) -> bool:
        """Whether a copy of this rank's parameters fits on their GPU with a
        tenth of it (and 1 GiB) to spare."""
        torch = _torch()
        need: Dict[Any, int] = {}
        for t in self.params.values():
            need[t.device] = need.get(t.device, 0) + t.numel() * t.element_size()
        if any(d.type != "cuda" for d in need):
            return False
        for dev, n in need.items():
            free, total = torch.cuda.mem_get_info(dev)
            if free - n < max(1 << 30, total // 10):
                return False
        return True

    def _load(self, into: Optional[Mapping[str, Any]] = None) -> None:
        """Copies this rank's elements of every checkpoint tensor from the
        host copy into its parameters (or into ``into``'s words instead)."""
        torch = _torch()
        arrays = self.host.arrays(writable=False)
        for cname, runs in self.mapping.tensors.items():
            arr = arrays[cname]
            with warnings.catch_warnings():  # read-only shared memory, only read
                warnings.simplefilter("ignore", UserWarning)
                src = torch.from_numpy(np.asarray(arr).view(_signed(arr.dtype.itemsize)))
            for r in runs:
                words = self._words(r.param) if into is None else into[r.param]
                copy_runs(words, src, r)

    def _stage_patch(self, h: Handoff) -> List[Tuple[Any, Any, Any]]:
        torch = _torch()
        vdir = Path(h.patch or "")
        t0 = time.perf_counter()
        corrupt = Corrupt(f"the hand-off of version {h.version} in {vdir} is missing or not the "
                          "node's (removed or changed under the follower); the node rebuilds it")
        meta = _patch_index(h)
        try:
            blob = None if meta is None else np.memmap(vdir / "patch.bin", dtype=np.uint8, mode="r")
        except (OSError, ValueError):
            blob = None
        if meta is None or blob is None or blob.size != meta["size"]:
            raise corrupt
        # This rank's stripes are hashed on a thread while the bytes it
        # needs are found, packed and copied to the device; nothing uses
        # them as positions or words there before the stripes match.
        stripes = self._checker.submit(_stripes_match, h, meta, self.rank, self.world)
        # What this rank's runs can touch of each tensor's changes — a
        # stretch found by binary searches of the positions here (a shard of
        # whole rows needs its rows' changes only) — goes where the
        # parameters are: one packed copy to a GPU; on the CPU, views of the
        # file. Positions are mapped, old words checked and new words picked
        # there, with two synchronizations in all.
        dev = next((t.device for t in self.params.values()), torch.device("cpu"))
        host = np.asarray(blob)
        parts = []
        for cname, e in meta["tensors"].items():
            if cname not in self.mapping.tensors or not e["n"]:
                continue
            pw, wb = e.get("pw", 8), e["wb"]
            # 32-bit positions are unsigned (torch reads them as int32).
            hpos = host[e["pos"]: e["pos"] + pw * e["n"]].view(np.uint32 if pw == 4 else np.int64)
            lo, hi = self.mapping.span(cname, hpos)
            if hi > lo:
                # (name, host positions, [(byte offset, bytes)] of its
                # positions, old words and new words in the patch)
                parts.append((cname, hpos[lo:hi], wb, pw, [
                    (e["pos"] + lo * pw, (hi - lo) * pw), (e["old"] + lo * wb, (hi - lo) * wb),
                    (e["new"] + lo * wb, (hi - lo) * wb)]))
        with warnings.catch_warnings():  # read-only memory, only read
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(host)
        t1 = time.perf_counter()
        copies, moved, self.upload_bytes = _pack_plan([r for p in parts for r in p[4]])
        if dev.type != "cpu":
            data = _packed_upload(blob, copies, self.upload_bytes, dev, self._staging)
            parts = [(c, hp, wb, pw, [moved[r] for r in rs]) for c, hp, wb, pw, rs in parts]
        t2 = time.perf_counter()
        if not stripes.result():
            raise corrupt
        t3 = time.perf_counter()
        staged = []
        checks: List[Tuple[str, str, Any, Any, Any]] = []
        wanted, words_of = [], {}
        for cname, hpos, wb, pw, ((po, pn), (oo, on), (no, nn)) in parts:
            words_t = _torch_words(wb)
            pos = data[po: po + pn]
            pos = (pos.view(torch.int32).to(torch.int64) & 0xFFFFFFFF if pw == 4
                   else pos.view(torch.int64))
            wanted.append((cname, hpos, pos))
            words_of[cname] = (data[oo: oo + on].view(words_t), data[no: no + nn].view(words_t),
                               words_t)
        for cname, pname, ppos, idx in self.mapping.locate_many(wanted):
            old, new, words_t = words_of[cname]
            words = self._words(pname)
            ppos = ppos.to(words.device)
            have = words.index_select(0, ppos).view(words_t)
            checks.append((pname, cname, ppos, have, old[idx].to(words.device)))
            staged.append((words, ppos, new[idx].to(words.device).view(words.dtype)))
        differ = [(have != want).any() for _p, _c, _pos, have, want in checks]
        # one transfer per device for all the verdicts
        by_device: Dict[Any, List[Any]] = {}
        for d in differ:
            by_device.setdefault(d.device, []).append(d)
        if any(bool(torch.stack(ds).any()) for ds in by_device.values()):
            for (pname, cname, ppos, have, want), d in zip(checks, differ):
                if bool(d):
                    bad = int(ppos[(have != want).nonzero()[0]])
                    raise BaseMismatch(
                        f"parameter `{pname}` (from `{cname}`) does not hold version {h.base} at "
                        f"element {bad}: nothing written"
                    )
        self.prepare_phases = {"check_s": t1 - t0, "upload_s": t2 - t1,
                               "check_wait_s": t3 - t2, "apply_s": time.perf_counter() - t3,
                               "upload_bytes": self.upload_bytes,
                               "patch_bytes": int(meta["size"])}
        return staged

    def commit(self) -> int:
        """Writes what :meth:`prepare` staged (one scatter per parameter)."""
        if self._staged is None:
            raise BadRequest("nothing is prepared")
        h, staged = self._staged
        started = time.perf_counter()
        if h.op == "load" and not staged:
            self._load()
        for words, pos, vals in staged:
            if pos is None:  # a load built on the device: the whole parameter
                words.copy_(vals)
            else:
                words.index_copy_(0, pos, vals)
        _synchronize(self.params.values())
        self.commit_seconds = time.perf_counter() - started
        self._staged = None
        self.version = h.version
        return h.version

    def abort(self) -> None:
        self._staged = None


def _pack_plan(ranges: List[Tuple[int, int]]
               ) -> Tuple[List[Tuple[int, int, int]], Dict[Tuple[int, int], Tuple[int, int]], int]:
    """How byte ``ranges`` (offset, length) of a file travel to a device,
    packed: ``[(source start, source end, destination offset)]`` copies,
    where each range lands (offset, length), and the bytes in all. Ranges
    closer than 64 KiB travel as one copy; every range keeps its offset
    modulo 8, so words stay aligned."""
    merged: List[List[int]] = []
    for off, n in sorted(set(r for r in ranges if r[1] > 0)):
        start = off - off % 8
        if merged and start - merged[-1][1] < (64 << 10):
            merged[-1][1] = max(merged[-1][1], off + n)
        else:
            merged.append([start, off + n])
    copies, at = [], 0
    for a, b in merged:
        copies.append((a, b, at))
        at += (b - a + 7) // 8 * 8
    starts = [a for a, _ in merged]
    moved = {}
    for off, n in ranges:
        if n == 0:  # nothing travels; an empty stretch, aligned alike
            moved[(off, n)] = (off % 8, 0)
            continue
        a, _b, to = copies[bisect.bisect_right(starts, off) - 1]
        moved[(off, n)] = (to + off - a, n)
    return copies, moved, at


def _packed_upload(blob: Any, copies: List[Tuple[int, int, int]], nbytes: int, dev: Any,
                   staging: Any) -> Any:
    """:func:`_pack_plan`'s copies of ``blob`` to ``dev``: the device bytes.
    The packed bytes are laid out in pinned buffers (a pageable copy moves
    about 4 GB/s) exactly as on the device, a piece at a time, and each
    piece travels in one transfer while the next is filled: one transfer
    per ``PATCH_CHUNK``, however many stretches the plan has."""
    torch = _torch()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    chunk, ring_n = _device.PATCH_CHUNK, _device.ANCHOR_RING
    ring = [staging.get(("anchor", k), _device.ANCHOR_CHUNK, True) for k in range(ring_n)]
    done: List[Any] = [None] * ring_n
    stream = torch.cuda.current_stream(dev)
    i = 0
    for j, start in enumerate(range(0, nbytes, chunk)):
        end = min(nbytes, start + chunk)
        k = j % ring_n
        if done[k] is not None:
            done[k].synchronize()
        i = _fill_piece(ring[k].numpy(), blob, copies, i, start, end)
        dst[start:end].copy_(ring[k][: end - start], non_blocking=True)
        done[k] = torch.cuda.Event()
        done[k].record(stream)
    torch.cuda.synchronize(dev)
    return dst


def _fill_piece(buf: Any, blob: Any, copies: List[Tuple[int, int, int]], i: int, start: int,
                end: int) -> int:
    """Lays bytes ``[start, end)`` of the packed layout (``copies``:
    ``(source start, source end, destination offset)``, destinations
    ascending) into ``buf[: end - start]``, from copy ``i`` on; returns the
    first copy that reaches past ``end``. The padding between stretches is
    left as it was (nothing reads it)."""
    while i < len(copies):
        a, b, to = copies[i]
        lo, hi = max(to, start), min(to + b - a, end)
        if lo < hi:
            buf[lo - start: hi - start] = blob[a + lo - to: a + hi - to]
        if to + b - a > end:
            break
        i += 1
    return i


def _synchronize(tensors: Any) -> None:
    """Waits for the writes on each CUDA device among ``tensors`` (the
    version is committed when they are done)."""
    torch = _torch()
    for dev in {t.device for t in tensors if t.device.type == "cuda"}:
        torch.cuda.synchronize(dev)


def _torch_words(wb: int) -> Any:
    torch = _torch()
    return {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[wb]


def _signed(wb: int) -> Any:
    return {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}[wb]


@dataclass
class StepReport:
    """What one step did, the same on every rank."""

    op: Optional[str]
    version: Optional[int]
    committed: bool
    versions: List[Optional[int]]
    failures: List[Optional[str]]
    # The node's work (download, verification, the patch), the slowest
    # rank's prepare, and the slowest rank's commit: the engine's pause.
    node_seconds: float = 0.0
    prepare_seconds: float = 0.0
    pause_seconds: float = 0.0

    def consistent(self) -> bool:
        return len(set(self.versions)) == 1


class _GroupLost(Exception):
    """A collective of the node's group failed: a rank died or timed out."""


class TensorParallelFollower:
    """The ranks of one engine following a bucket together (see the
    module). Construct and call :meth:`step` on every rank at once (vLLM's
    ``collective_rpc`` does); ``group`` is a ``torch.distributed`` process
    group of the node's ranks (a gloo group on CPU; default: the world),
    ``node_rank`` the rank within ``group`` that hosts the node's subscriber. ``params``: this
    rank's parameters (name → tensor; a module's ``named_parameters``);
    ``loader``: the engine's loader (``model.load_weights``), probed once to
    map checkpoint coordinates to ``params``. ``root``: node-local shared
    memory for the host copy and hand-offs."""

    def __init__(
        self,
        store_url: Optional[str],
        params: Mapping[str, Any],
        loader: Callable[[Any], Any],
        *,
        root: str | os.PathLike[str],
        group: Any = None,
        node_rank: int = 0,
        fail_prepare: Optional[Callable[[Handoff], None]] = None,
        fail_commit: Optional[Callable[[Handoff], None]] = None,
        **subscriber_options: Any,
    ) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.node_rank = node_rank
        self.root = Path(root)
        self.params = dict(params)
        self.loader = loader
        self.node: Optional[NodeFollower] = None
        if self.rank == node_rank:
            if store_url is None:
                raise BadRequest("the node's rank needs the store URL")
            self.node = NodeFollower(store_url, self.root, **subscriber_options)
        self.rank_follower: Optional[RankFollower] = None
        self._fail_prepare = fail_prepare
        self._fail_commit = fail_commit
        # Set when a collective failed (a rank died, or did not answer
        # within the group's timeout): the group cannot vote again.
        self._lost: Optional[str] = None
        # The step under way: its hand-off, and whether this rank committed it.
        self._current: Optional[Handoff] = None
        self._committed = False
        self._repair = False
        self.last: Optional[StepReport] = None

    def _bcast(self, obj: Any) -> Any:
        box = [obj]
        # ``src`` is a global rank; ``node_rank`` is the node's rank within
        # ``group`` (they differ in a subgroup: a TP group of the second node).
        src = self.node_rank if self.group is None else self.dist.get_global_rank(
            self.group, self.node_rank)
        try:
            self.dist.broadcast_object_list(box, src=src, group=self.group)
        except Exception as e:  # a peer died or timed out: the group is gone
            raise _GroupLost(f"{type(e).__name__}: {e}") from e
        return box[0]

    def _all(self, obj: Any) -> List[Any]:
        out: List[Any] = [None] * self.world
        try:
            self.dist.all_gather_object(out, obj, group=self.group)
        except Exception as e:  # a peer died or timed out: the group is gone
            raise _GroupLost(f"{type(e).__name__}: {e}") from e
        return out

    def step(self, timeout: float = 0.0) -> StepReport:
        """One step on every rank: the node's next version (or a repair of
        ranks behind it) prepared everywhere, committed everywhere or
        nowhere.

        A rank that dies (or does not answer within the process group's
        timeout) breaks the group: the survivors' collective fails, nothing
        they staged is written (before the vote no rank commits; after it,
        those that voted commit the version everyone prepared), the step
        reports the loss with the versions this rank knows, and every later
        step raises :class:`weightcast.Unavailable`: restart the engine's
        workers, which follow from the bucket again (the node's host copy
        is rebuilt)."""
        if self._lost is not None:
            raise Unavailable(
                f"this engine's process group lost a rank ({self._lost}); restart its "
                "workers: they follow from the bucket again")
        self._current, self._committed = None, False
        try:
            return self._step(timeout)
        except _GroupLost as e:
            self._lost = str(e)
            h = self._current
            if not self._committed:
                if self.rank_follower is not None:
                    self.rank_follower.abort()
                if self.node is not None and isinstance(h, Handoff):
                    self.node.abort(h)
            versions: List[Optional[int]] = [None] * self.world
            versions[self.rank] = self._version()
            failures: List[Optional[str]] = [None] * self.world
            failures[self.rank] = f"the process group lost a rank: {e}"
            logger.error("rank %d: the process group lost a rank (%s); committed: %s",
                         self.rank, e, self._committed)
            self.last = StepReport(h.op if isinstance(h, Handoff) else None,
                                   h.version if isinstance(h, Handoff) else None,
                                   self._committed, versions, failures)
            if self.node is not None:
                self.node.subscriber._native.report_ranks(versions)
            return self.last

    def _step(self, timeout: float) -> StepReport:
        started = time.perf_counter()
        handoff = None
        node_s = 0.0
        if self.node is not None:
            try:
                behind = self._repair or (self.last is not None and not (
                    self.last.consistent() and self.last.versions[0] == self.node.version))
                if behind and self.node.version is not None:
                    handoff = self.node.load_handoff()
                else:
                    handoff = self.node.next(timeout)
            except Exception as e:  # the node's own failure: reported, nothing moves
                logger.warning("node follower: %s", e)
                handoff = ("error", str(e))
            if isinstance(handoff, Handoff) and handoff.op == "load":
                handoff = (handoff, self.node.host.specs())
            node_s = time.perf_counter() - started
        msg = self._bcast(handoff)
        if msg is None or (isinstance(msg, tuple) and msg[0] == "error"):
            versions = self._all(self._version())
            err = msg[1] if isinstance(msg, tuple) else None
            self.last = StepReport(None, None, False, versions,
                                   [err if i == self.node_rank else None for i in range(self.world)])
            return self.last
        error = None
        if isinstance(msg, tuple):
            h, specs = msg
            try:
                self._ensure_mapping(specs)
            except Exception as e:  # refused on every rank alike: nothing moves
                error = f"{type(e).__name__}: {e}"
        else:
            h = msg
        self._current = h
        t0 = time.perf_counter()
        try:
            if error is not None:
                raise BadRequest(error)
            if self.rank_follower is None:
                raise BadRequest("this rank has no mapping yet (the node holds no anchor)")
            if self._fail_prepare is not None:
                self._fail_prepare(h)
            self.rank_follower.prepare(h)
        except Exception as e:  # any rank's failure stops every rank
            error = f"{type(e).__name__}: {e}"
            logger.warning("rank %d could not prepare version %s: %s", self.rank, h.version, error)
        prepare_s = time.perf_counter() - t0
        votes = self._all(error)
        everyone = all(v is None for v in votes)
        commit_s = 0.0
        if everyone:
            assert self.rank_follower is not None
            if self._fail_commit is not None:
                self._fail_commit(h)
            self.rank_follower.commit()
            self._committed = True
            commit_s = self.rank_follower.commit_seconds
            if self.node is not None:
                self.node.commit(h)
        else:
            if self.rank_follower is not None:
                self.rank_follower.abort()
            if self.node is not None:
                self.node.abort(h)
        gathered = self._all((self._version(), prepare_s, commit_s))
        versions = [g[0] for g in gathered]
        # A rank whose parameters did not hold what the node holds is
        # repaired from the node's host copy at the next step.
        self._repair = not everyone and any(
            v is not None and ("BaseMismatch" in v or "Corrupt" in v) for v in votes)
        self.last = StepReport(h.op, h.version, everyone, versions, votes,
                               self._bcast(node_s), max(g[1] for g in gathered),
                               max(g[2] for g in gathered))
        if not self.last.consistent():
            logger.error("ranks hold different versions: %s", versions)
        if self.node is not None:
            self.node.subscriber._native.report_ranks(versions)
        return self.last

    @property
    def version(self) -> Optional[int]:
        """The version this rank's parameters hold (``None``: none yet)."""
        return self._version()

    def _version(self) -> Optional[int]:
        return None if self.rank_follower is None else self.rank_follower.version

    def _ensure_mapping(self, specs: Mapping[str, Spec]) -> None:
        if self.rank_follower is not None and getattr(self, "_specs", None) == specs:
            return
        try:
            mapping: Optional[ShardMap] = probe(
                self.params, {n: (d, s) for n, (d, s) in specs.items()}, self.loader)
            held: Any = {n: sum(r.elements() for r in runs)
                         for n, runs in mapping.tensors.items()}
        except Exception as e:  # every rank learns of it (the gather below is collective)
            mapping, held = None, f"rank {self.rank}: {type(e).__name__}: {e}"
        # Every element of every checkpoint tensor lands on some rank, or a
        # delta to it would go nowhere: refused at start-up, naming it.
        counts: Dict[str, int] = {}
        for h in self._all(held):
            if isinstance(h, str):
                raise Unmappable(f"the engine's layout could not be mapped on {h}")
            for n, k in h.items():
                counts[n] = counts.get(n, 0) + k
        for n, (_, shape) in specs.items():
            need = int(np.prod(shape, dtype=np.int64))
            if counts.get(n, 0) < need:
                raise Unmappable(
                    f"checkpoint tensor `{n}`: {need - counts.get(n, 0)} of its {need} elements "
                    "land in no rank's parameters (the engine does not hold it, or its loader "
                    "drops part of it); follow this model with the engine's reload"
                )
        assert mapping is not None
        self._specs = dict(specs)
        self.rank_follower = RankFollower(self.params, mapping, self.root, self.rank, self.world)
