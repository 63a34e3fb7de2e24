"""The trainer side on a GPU: find a version's changes on the device.

A :class:`DeviceBase` holds a copy, on the tensors' own device, of the last
version the publisher committed. Publishing the next version compares each
tensor with its copy there (bit patterns, so NaNs and signed zeros count),
moves only the changed positions (32-bit where the tensor allows) and their
new words to pinned host memory, and hands them to the library, which
encodes the delta with the old words read from its snapshot at those
positions only (``Publisher::publish_changes``). The copy then takes the
published words. Nothing crosses PCIe or is read on the host in full.

The library checks every listed word against its snapshot: a copy that is
not the snapshot (a change it missed shows up as a listed word the snapshot
already holds) writes nothing, and the publisher goes the full way and
takes a fresh copy.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ._tensors import dtype_of, is_torch, shape_of, word_view

logger = logging.getLogger("weightcast")

Key = Tuple[str, str]
# (name, dtype, shape, positions address, count, width, new words address, bytes)
ChangeSpec = Tuple[str, str, List[int], int, int, int, int, int]


def _torch() -> Any:
    import torch

    return torch


class DeviceBase:
    """The device copy of the last committed version, and pinned staging
    buffers for the changes, kept across versions."""

    def __init__(self) -> None:
        self.copy: Optional[Dict[Key, Any]] = None
        self.version: Optional[int] = None
        self._pos: Any = None
        self._val: Any = None
        self._pending: List[Tuple[Any, Any, Any]] = []

    def drop(self) -> None:
        self.copy, self.version, self._pending = None, None, []

    @staticmethod
    def eligible(groups: Mapping[str, Mapping[str, Any]], want: Optional[bool]) -> bool:
        """Whether these tensors can be diffed where they are: torch tensors,
        contiguous, of whole-byte words; on a GPU, or anywhere when ``want``
        is True."""
        if want is False:
            return False
        torch = _torch()
        for group in groups.values():
            for t in group.values():
                if not is_torch(t) or not t.is_contiguous() or t.element_size() not in (1, 2, 4, 8):
                    return False
                if want is None and t.device.type != "cuda":
                    return False
                if t.dtype in (torch.bool,):
                    return False
        return True

    @staticmethod
    def fits(groups: Mapping[str, Mapping[str, Any]]) -> bool:
        """For the automatic choice: a copy of the tensors leaves at least a
        tenth of each device (and 1 GiB) free."""
        torch = _torch()
        need: Dict[Any, int] = {}
        for group in groups.values():
            for t in group.values():
                need[t.device] = need.get(t.device, 0) + t.numel() * t.element_size()
        for dev, n in need.items():
            if dev.type != "cuda":
                continue
            free, total = torch.cuda.mem_get_info(dev)
            if free - n < max(1 << 30, total // 10):
                logger.info("no device copy for diffing on %s: %d bytes needed, %d free of %d; "
                            "publishing through host memory", dev, n, free, total)
                return False
        return True

    def matches(self, groups: Mapping[str, Mapping[str, Any]], version: Optional[int]) -> bool:
        """Whether the copy is of these tensors (names, dtypes, shapes,
        devices) and of the version the library last committed."""
        if self.copy is None or version is None or version != self.version:
            return False
        n = 0
        for file, group in groups.items():
            for name, t in group.items():
                b = self.copy.get((file, str(name)))
                if b is None or b.dtype != t.dtype or b.shape != t.shape or b.device != t.device:
                    return False
                n += 1
        return n == len(self.copy)

    def take(self, groups: Mapping[str, Mapping[str, Any]]) -> Dict[Key, Any]:
        """A copy of every tensor, in stream order (queued after whatever the
        caller queued before, e.g. the host copies of the same publish)."""
        self.drop()
        return {(file, str(name)): t.detach().clone()
                for file, group in groups.items() for name, t in group.items()}

    def adopt(self, copy: Dict[Key, Any], version: int) -> None:
        self.copy, self.version = copy, int(version)

    def _staging(self, attr: str, nbytes: int, pin: bool) -> Any:
        torch = _torch()
        buf = getattr(self, attr)
        if buf is None or buf.numel() < nbytes:
            size = max(nbytes + nbytes // 4, 1 << 20)
            try:
                buf = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
            except RuntimeError:
                buf = torch.empty(size, dtype=torch.uint8)
            setattr(self, attr, buf)
        return buf

    def changes(self, groups: Mapping[str, Mapping[str, Any]]
                ) -> Tuple[List[Tuple[str, List[ChangeSpec]]], Dict[str, float]]:
        """Every tensor's changes against the copy, staged in host memory:
        the specs ``publish_changes`` takes (valid until the next call), and
        timings. :meth:`advance` applies them to the copy once committed."""
        import time

        torch = _torch()
        t0 = time.perf_counter()
        found = []  # (file, name, tensor, words, positions on device, new words on device)
        for file, group in groups.items():
            for name, t in group.items():
                es = t.element_size()
                words = word_view(str(name), t, es)
                base = word_view(str(name), self.copy[(file, str(name))], es)
                pos = (words != base).nonzero().view(-1)
                found.append((file, str(name), t, words, pos, words.index_select(0, pos)))
        t1 = time.perf_counter()
        cuda = any(f[2].device.type == "cuda" for f in found)
        pos_bytes = val_bytes = 0
        plan = []
        for file, name, t, words, pos, new in found:
            width = 4 if words.numel() <= 2**31 else 8
            n = pos.numel()
            plan.append((pos_bytes, val_bytes, width, n))
            pos_bytes += (n * width + 7) // 8 * 8
            val_bytes += (n * t.element_size() + 7) // 8 * 8
        pos_buf = self._staging("_pos", pos_bytes, cuda)
        val_buf = self._staging("_val", val_bytes, cuda)
        pending, by_file, keep = [], {}, []
        for (file, name, t, words, pos, new), (po, vo, width, n) in zip(found, plan):
            es = t.element_size()
            if n:
                p = pos.to(torch.int32) if width == 4 else pos
                keep.append(p)
                pos_buf.narrow(0, po, n * width).view(p.dtype).copy_(p, non_blocking=True)
                val_buf.narrow(0, vo, n * es).view(new.dtype).copy_(new, non_blocking=True)
                pending.append((self.copy[(file, name)], pos, new))
            spec = (name, dtype_of(name, t), shape_of(t), pos_buf.data_ptr() + po, n, width,
                    val_buf.data_ptr() + vo, n * es)
            by_file.setdefault(file, []).append(spec)
        if cuda:
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        self._pending = pending
        return list(by_file.items()), {"device_diff_s": t1 - t0, "to_host_s": t2 - t1,
                                       "changed": float(sum(p[3] for p in plan))}

    def advance(self, version: int) -> None:
        """The version of the last :meth:`changes` is committed: the copy
        takes its new words."""
        for base, pos, new in self._pending:
            es = base.element_size()
            word_view("base", base, es).index_copy_(0, pos, new)
        self._pending = []
        self.version = int(version)
