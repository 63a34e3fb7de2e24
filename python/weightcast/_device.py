"""The device path: a version onto tensors the library cannot write (CUDA
tensors; CPU tensors too with ``via="scatter"``).

A delta, in batches across every tensor it changes:

1. the library decodes every change (tensors and blocks in parallel) and
   writes all positions into one host buffer (pinned when CUDA is there);
2. one copy moves them to each device, where ``index_select`` gathers the old
   words of every tensor into one buffer, which one copy brings back;
3. the library checks every tensor's old words against the delta's base
   (digests, in parallel) and writes the new words into a second host
   buffer, which one copy moves to the device;
4. the commit (the engine's pause) is one ``index_copy_`` per tensor.

Per change that is 4 bytes of positions to the device (8 for tensors of more
than 2^32 words), 2 of old words back and 2 of new words over for bf16:
nothing per element runs in Python. Until the commit the device holds 8
bytes (the int64 index) plus the new word per change.

An anchor is copied through a ring of pinned buffers, so the copy into them
and the transfer to the device overlap.
"""

from __future__ import annotations

import ctypes
import time
from typing import Any, Dict, List, Mapping, Tuple

import numpy as np

from ._tensors import _torch, is_torch, word_view

# Bytes per pinned buffer of the anchor's ring, and buffers in the ring.
ANCHOR_CHUNK = 32 << 20
ANCHOR_RING = 4
#: A rank's share of a node's patch travels in smaller pieces of the same
#: ring: it is tens of MB, so the first piece's copy into pinned memory
#: (which nothing overlaps) and the last one's transfer weigh more than in
#: an anchor.
PATCH_CHUNK = 8 << 20

# Signed words of each width (the integer dtypes torch indexes with on every
# version).
_SIGNED = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}

# (name, changes, position width, word width, position offset, word offset)
Plan = List[Tuple[str, int, int, int, int, int]]


# Seconds of each phase of the last delta staged (for benchmarks): decode,
# positions, gather, resolve, upload.
last: Dict[str, float] = {}


class Staging:
    """Host buffers kept from one version to the next (pinned when CUDA is
    available, so copies to and from a device are asynchronous)."""

    def __init__(self) -> None:
        self._bufs: Dict[Any, Any] = {}
        self._cannot_pin = False

    def get(self, key: Any, nbytes: int, pin: bool) -> Any:
        torch = _torch()
        buf = self._bufs.get(key)
        pin = pin and not self._cannot_pin
        if buf is None or buf.numel() < nbytes or (pin and not buf.is_pinned()):
            # A quarter of headroom: the next version's changes differ a
            # little in number, and pinning memory again costs more than
            # the copies it serves.
            size = max(nbytes + nbytes // 4, 0 if buf is None else buf.numel() + buf.numel() // 2)
            buf = None
            try:
                buf = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
            except RuntimeError:  # no pinnable memory: pageable (synchronous copies)
                self._cannot_pin = True
                buf = torch.empty(size, dtype=torch.uint8)
            self._bufs[key] = buf
        return buf[:nbytes]


def _address(buf: Any) -> int:
    if is_torch(buf):
        return buf.data_ptr() if buf.numel() else 0
    return int(buf.__array_interface__["data"][0]) if buf.nbytes else 0


def stage_delta(native: Any, params: Mapping[str, Any], staging: Staging) -> Tuple[List[Any], Plan]:
    """Steps 1–3 above; returns the writes for :func:`write` and the plan
    (each tensor's name and number of changes)."""
    started = time.perf_counter()
    plan, pos_bytes, word_bytes = native.device_changes()
    last.clear()
    last["decode"] = time.perf_counter() - started
    torch = _torch()
    if torch is not None and any(is_torch(params[p[0]]) for p in plan):
        return _stage_torch(native, params, staging, plan, pos_bytes, word_bytes), plan
    return _stage_numpy(native, params, plan, pos_bytes, word_bytes), plan


def _stage_numpy(native: Any, params: Mapping[str, Any], plan: Plan, pos_bytes: int,
                 word_bytes: int) -> List[Any]:
    positions = np.empty(pos_bytes, dtype=np.uint8)
    native.device_positions(_address(positions), pos_bytes)
    old = np.empty(word_bytes, dtype=np.uint8)
    new = np.empty(word_bytes, dtype=np.uint8)
    staged = []
    for name, n, pw, wb, po, wo in plan:
        words = word_view(name, params[name], wb)
        idx = positions[po:po + n * pw].view(np.uint32 if pw == 4 else np.uint64).astype(np.intp)
        old[wo:wo + n * wb].view(words.dtype)[:] = words[idx]
        staged.append((words, idx, wo, n * wb))
    native.device_resolve((_address(old), word_bytes), (_address(new), word_bytes))
    return [(words, idx, new[wo:wo + nb].view(words.dtype)) for words, idx, wo, nb in staged]


def _stage_torch(native: Any, params: Mapping[str, Any], staging: Staging, plan: Plan,
                 pos_bytes: int, word_bytes: int) -> List[Any]:
    torch = _torch()
    words_of = {}
    for name, _n, _pw, wb, _po, _wo in plan:
        words = word_view(name, params[name], wb)
        if not is_torch(words):  # a numpy array among torch tensors
            words = torch.from_numpy(words.view(_SIGNED[wb]))
        words_of[name] = words
    devices: Dict[Any, List[Tuple[str, int, int, int, int, int]]] = {}
    for p in plan:
        devices.setdefault(words_of[p[0]].device, []).append(p)
    cuda = any(d.type == "cuda" for d in devices)
    positions = staging.get("positions", pos_bytes, cuda)
    t = time.perf_counter()
    native.device_positions(_address(positions), pos_bytes)
    last["positions"] = time.perf_counter() - t
    t = time.perf_counter()
    old = staging.get("old", word_bytes, cuda)
    staged: Dict[str, Tuple[Any, Any, int, int]] = {}
    for dev, items in devices.items():
        on_host = dev.type == "cpu"
        pos_d = positions if on_host else positions.to(dev, non_blocking=True)
        old_d = old if on_host else torch.empty(word_bytes, dtype=torch.uint8, device=dev)
        for name, n, pw, wb, po, wo in items:
            words = words_of[name]
            idx = pos_d[po:po + n * pw].view(torch.int32 if pw == 4 else torch.int64)
            idx = idx.to(torch.int64)
            if pw == 4 and words.numel() > 2**31:
                idx &= 0xFFFFFFFF  # u32 positions past 2^31 read as negative int32
            torch.index_select(words, 0, idx, out=old_d[wo:wo + n * wb].view(words.dtype))
            staged[name] = (words, idx, wo, n * wb)
        if not on_host:
            if len(devices) == 1:
                old.copy_(old_d, non_blocking=True)
            else:
                for _name, n, _pw, wb, _po, wo in items:
                    old[wo:wo + n * wb].copy_(old_d[wo:wo + n * wb], non_blocking=True)
    _sync(devices)
    last["gather"] = time.perf_counter() - t
    # A fresh buffer on the host (the writes keep it); pinned staging for devices.
    new = staging.get("new", word_bytes, True) if cuda else torch.empty(word_bytes,
                                                                       dtype=torch.uint8)
    t = time.perf_counter()
    native.device_resolve((_address(old), word_bytes), (_address(new), word_bytes))
    last["resolve"] = time.perf_counter() - t
    t = time.perf_counter()
    on_dev = {dev: new if dev.type == "cpu" else new.to(dev, non_blocking=True) for dev in devices}
    writes = []
    for name, *_ in plan:  # in the plan's order
        words, idx, wo, nb = staged[name]
        writes.append((words, idx, on_dev[words.device][wo:wo + nb].view(words.dtype)))
    _sync(devices)  # the staging buffers are free again
    last["upload"] = time.perf_counter() - t
    return writes


def _sync(devices: Any) -> None:
    torch = _torch()
    for dev in devices:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)


def write(writes: List[Any]) -> None:
    """Step 4: the staged new words into the tensors."""
    for words, idx, vals in writes:
        if is_torch(words):
            words.index_copy_(0, idx, vals)
        else:
            words[idx] = vals


def upload(pairs: List[Tuple[Any, int, int]], staging: Staging) -> None:
    """Copies host memory into CUDA tensors: ``(destination bytes (a flat
    uint8 view), source address, bytes)``, through a ring of pinned buffers
    so that filling one overlaps the transfer of the others."""
    torch = _torch()
    ring = [staging.get(("anchor", k), ANCHOR_CHUNK, True) for k in range(ANCHOR_RING)]
    done: List[Any] = [None] * ANCHOR_RING
    j = 0
    devices = set()
    for dst, at, n in pairs:
        if n == 0:
            continue
        devices.add(dst.device)
        src = torch.frombuffer((ctypes.c_uint8 * n).from_address(at), dtype=torch.uint8)
        stream = torch.cuda.current_stream(dst.device)
        for off in range(0, n, ANCHOR_CHUNK):
            m = min(ANCHOR_CHUNK, n - off)
            k = j % ANCHOR_RING
            if done[k] is not None:
                done[k].synchronize()
            ring[k][:m].copy_(src[off:off + m])
            dst[off:off + m].copy_(ring[k][:m], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
            done[k] = ev
            j += 1
        del src
    _sync(devices)
