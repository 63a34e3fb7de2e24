"""Checkpoint coordinates to an engine's own parameters: sharded, fused,
padded — derived from the engine's weight loaders, never written per model.

A tensor-parallel engine does not hold the checkpoint's tensors: vLLM and
SGLang fuse ``q_proj``/``k_proj``/``v_proj`` into ``qkv_proj`` and
``gate_proj``/``up_proj`` into ``gate_up_proj``, stack MoE experts into one
tensor, and give each rank a slice (column-parallel rows, row-parallel
columns, a padded vocabulary range). Their loaders know how; weightcast asks
them once, at start-up (:func:`probe`):

- every parameter's memory is swapped for an ``int64`` proxy filled with 0;
- the engine's loader (``model.load_weights``) is fed, for each checkpoint
  tensor, a tensor of its shape whose elements are their own global index
  + 1 (1-based, so that a loader's zero fill of padding reads as "no
  element");
- what lands in each proxy says, for every element of every parameter,
  which checkpoint element it holds. Contiguous stretches become *runs*
  ``(checkpoint start, parameter start, length)``, a few per row.

Then a delta's changed positions (checkpoint coordinates) map to each
rank's parameter positions in O(changed · log runs), with no full tensor
materialized: :meth:`Mapping.locate`. A layout the probe cannot map
exactly — a parameter whose dtype the checkpoint cannot fill (quantized or
FP8 kernel formats), a loader that writes values that are not the probe's
(a transform), an element written twice within a rank — is refused by name
at start-up: :class:`Unmappable`; use the engine's own reload for that
model.

The proxies cost 8 bytes per element of the rank's parameters while the
probe runs (one pass, before serving); the runs cost 24 bytes per run.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from ._errors import BadRequest

Loader = Callable[[Iterable[Tuple[str, Any]]], Any]

# Parameter dtypes a checkpoint element lands in unchanged.
_PLAIN = ("float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64",
          "uint8", "bool")


class Unmappable(BadRequest):
    """The engine's layout cannot be patched in place (named in the
    message); follow this model with the engine's own reload instead."""


def _torch():
    import torch

    return torch


@dataclass
class Runs:
    """Where one checkpoint tensor's elements are in one parameter: sorted
    by checkpoint start; each run maps ``length`` consecutive checkpoint
    elements to consecutive parameter elements."""

    param: str
    ckpt_start: Any  # int64 tensor
    param_start: Any
    length: Any
    # (first checkpoint start, checkpoint stride, first parameter start,
    # parameter stride, length, count) when the runs are rows of a regular
    # grid (a shard of rows or columns): positions then map arithmetically.
    grid: Optional[Tuple[int, int, int, int, int, int]] = None
    _copies: Dict[str, Tuple[Any, Any, Any]] = field(default_factory=dict, repr=False,
                                                      compare=False)

    def __post_init__(self) -> None:
        k = self.length.numel()
        if k == 0:
            return
        L = int(self.length[0])
        if k == 1:
            self.grid = (int(self.ckpt_start[0]), L, int(self.param_start[0]), L, L, 1)
            return
        cs, ps = self.ckpt_start, self.param_start
        sstride, pstride = int(cs[1] - cs[0]), int(ps[1] - ps[0])
        if (sstride >= L and pstride >= L and bool((self.length == L).all())
                and bool((cs[1:] - cs[:-1] == sstride).all())
                and bool((ps[1:] - ps[:-1] == pstride).all())):
            self.grid = (int(cs[0]), sstride, int(ps[0]), pstride, L, k)

    def bounds(self) -> Tuple[int, int]:
        """The first checkpoint element the runs hold, and one past the
        last."""
        if self.grid is not None:
            c0, cstride, _p0, _ps, L, count = self.grid
            return c0, c0 + (count - 1) * cstride + L
        if not self.length.numel():
            return 0, 0
        return int(self.ckpt_start[0]), int((self.ckpt_start + self.length).max())

    def elements(self) -> int:
        return int(self.length.sum())

    def on(self, device: Any) -> Tuple[Any, Any, Any]:
        """(checkpoint starts, parameter starts, lengths) on ``device``
        (copied there once)."""
        key = str(device)
        if key not in self._copies:
            self._copies[key] = tuple(t.to(device) for t in
                                      (self.ckpt_start, self.param_start, self.length))
        return self._copies[key]


@dataclass
class Mapping:
    """One rank's map from checkpoint tensors to its parameters."""

    # checkpoint tensor name -> runs, one entry per parameter it lands in
    tensors: Dict[str, List[Runs]] = field(default_factory=dict)
    # parameter name -> (dtype, shape)
    params: Dict[str, Tuple[str, Tuple[int, ...]]] = field(default_factory=dict)
    # parameter name -> elements no checkpoint element lands in (padding)
    unmapped: Dict[str, int] = field(default_factory=dict)

    def fingerprint(self) -> str:
        """A digest of the mapping (it must not change after start-up)."""
        h = hashlib.blake2b(digest_size=16)
        for name in sorted(self.tensors):
            for r in self.tensors[name]:
                h.update(f"{name}>{r.param}".encode())
                for t in (r.ckpt_start, r.param_start, r.length):
                    h.update(t.numpy().tobytes())
        h.update(json.dumps(sorted(self.params.items())).encode())
        return h.hexdigest()

    def locate(self, tensor: str, positions: Any) -> List[Tuple[str, Any, Any]]:
        """For sorted checkpoint positions of ``tensor`` (int64), the ones
        this rank holds: ``[(parameter, parameter positions, index into
        positions)]``."""
        return [(p, pos, idx) for _t, p, pos, idx in
                self.locate_many([(tensor, positions.cpu().numpy(), positions)])]

    def span(self, tensor: str, host: Any) -> Tuple[int, int]:
        """The stretch ``[lo, hi)`` of ``tensor``'s sorted checkpoint
        positions (a numpy array) that this rank's runs can touch: the
        changes outside it land on other ranks."""
        lo, hi = int(host.size), 0
        for r in self.tensors.get(tensor, []):
            first, end = r.bounds()
            a, b = _search(host, first), _search(host, end)
            if b > a:
                lo, hi = min(lo, a), max(hi, b)
        return (lo, hi) if hi > lo else (0, 0)

    def locate_many(self, items: Sequence[Tuple[str, Any, Any]]
                    ) -> List[Tuple[str, str, Any, Any]]:
        """:meth:`locate` for many tensors at once, with one synchronization
        of the positions' device in all: ``items`` are ``(tensor, sorted
        positions in host memory (a numpy array), the same positions as an
        int64 tensor where the work runs)``; returns ``[(tensor, parameter,
        parameter positions, index into that tensor's positions: a tensor
        or a slice)]``.

        A grid's span is found by a binary search of the host copy; a shard
        of whole rows is then a shift of a slice. Positions that need a
        filter (a shard of columns, irregular runs) are masked on the
        device; every mask is counted in one transfer, and each is
        compacted to its known count without waiting again."""
        torch = _torch()
        out: List[Tuple[str, str, Any, Any]] = []
        masked: List[Tuple[str, str, Any, Any, int]] = []
        for tensor, host, positions in items:
            for r in self.tensors.get(tensor, []):
                if r.grid is not None:
                    c0, cstride, p0, pstride, L, count = r.grid
                    # The positions within the grid's span (they are sorted).
                    lo, hi = _search(host, c0), _search(host, c0 + (count - 1) * cstride + L)
                    if hi <= lo:
                        continue
                    if cstride == L and pstride == L:
                        # One stretch on both sides (a shard of whole rows, a
                        # replicated tensor): a shift, nothing to filter.
                        out.append((tensor, r.param, positions[lo:hi] - (c0 - p0), slice(lo, hi)))
                        continue
                    rel = positions[lo:hi] - c0
                    row = torch.div(rel, cstride, rounding_mode="floor")
                    col = rel - row * cstride
                    masked.append((tensor, r.param, p0 + row * pstride + col, col < L, lo))
                    continue
                cs, ps, ln = r.on(positions.device)
                k = torch.searchsorted(cs, positions, right=True) - 1
                kc = k.clamp(min=0)
                off = positions - cs[kc]
                masked.append((tensor, r.param, ps[kc] + off, (k >= 0) & (off < ln[kc]), 0))
        if masked:
            counts = torch.stack([m.sum() for *_, m, _ in masked]).tolist()
            for (tensor, param, at, mask, lo), n in zip(masked, counts):
                if n:
                    keep = torch.nonzero_static(mask, size=int(n)).flatten()
                    out.append((tensor, param, at[keep], keep + lo))
        return out


def _search(host: Any, value: int) -> int:
    """Where ``value`` goes in the sorted integer array ``host`` (a binary
    search; a value past the dtype's range goes after everything)."""
    import numpy as np

    if value > np.iinfo(host.dtype).max:
        return int(host.size)
    if value < np.iinfo(host.dtype).min:
        return 0
    return int(np.searchsorted(host, host.dtype.type(value)))


def _runs(ckpt: Any, param_pos: Any) -> Tuple[Any, Any, Any]:
    """Runs from matching (checkpoint, parameter) position pairs sorted by
    parameter position: consecutive in both."""
    torch = _torch()
    if ckpt.numel() == 0:
        z = torch.zeros(0, dtype=torch.int64)
        return z, z, z
    brk = torch.ones(ckpt.numel(), dtype=torch.bool)
    brk[1:] = (ckpt[1:] - ckpt[:-1] != 1) | (param_pos[1:] - param_pos[:-1] != 1)
    starts = brk.nonzero().flatten()
    ends = torch.cat([starts[1:], torch.tensor([ckpt.numel()])])
    cs, ps, ln = ckpt[starts], param_pos[starts], ends - starts
    order = torch.argsort(cs)
    return cs[order].contiguous(), ps[order].contiguous(), ln[order].contiguous()


def _rows(data: Any, pname: str, bases: List[Tuple[int, str, int]], starts: Any,
          mapping: "Mapping") -> bool:
    """The probe's fast path: a parameter whose every row (last dimension)
    is either untouched (all 0) or one contiguous stretch of one checkpoint
    tensor gets one run per row without sorting its elements. False when
    the parameter is not that regular (the general path maps it)."""
    torch = _torch()
    if data.dim() < 2 or data.numel() == 0:
        return False
    m = data.reshape(-1, data.shape[-1])
    first = m[:, 0].to(torch.int64)
    mapped = first > 0
    rows = mapped.nonzero().flatten()
    unmapped_rows = m[~mapped]
    if unmapped_rows.numel() and bool((unmapped_rows != 0).any()):
        return False
    sub = m[rows].to(torch.int64)
    if sub.numel() == 0:
        mapping.unmapped[pname] = data.numel()
        return True
    C = m.shape[1]
    if C > 1 and not bool((sub[:, 1:] - sub[:, :-1] == 1).all()):
        return False
    which = torch.searchsorted(starts, sub[:, 0].contiguous(), right=True) - 1
    last = torch.searchsorted(starts, sub[:, -1].contiguous(), right=True) - 1
    if not bool((which == last).all()):
        return False  # a row spanning two checkpoint tensors
    mapping.unmapped[pname] = data.numel() - sub.numel()
    for t in torch.unique(which).tolist():
        base, cname, _ = bases[t]
        sel = (which == t).nonzero().flatten()
        cs = sub[sel, 0] - base
        ps = rows[sel] * C
        order = torch.argsort(cs)
        mapping.tensors.setdefault(cname, []).append(
            Runs(pname, cs[order].contiguous(), ps[order].contiguous(),
                 torch.full((sel.numel(),), C, dtype=torch.int64)))
    return True


def probe(
    params: Mapping[str, Any],
    checkpoint: Mapping[str, Tuple[str, Sequence[int]]],
    loader: Loader,
) -> "Mapping":
    """The map from ``checkpoint`` (name → (safetensors dtype, shape)) to
    ``params`` (the engine's parameters on this rank: name → tensor), as
    ``loader`` (e.g. ``model.load_weights``) places each checkpoint tensor.
    The parameters are restored before it returns, whatever happens."""
    torch = _torch()
    swapped: Dict[str, Any] = {}
    mapping = Mapping()
    for name, p in params.items():
        dt = str(p.dtype).removeprefix("torch.")
        if dt not in _PLAIN:
            raise Unmappable(
                f"parameter `{name}` is {dt}: a kernel format the checkpoint's elements do not "
                "land in unchanged (quantized/FP8); follow this model with the engine's reload"
            )
        mapping.params[name] = (dt, tuple(p.shape))
    bases: List[Tuple[int, str, int]] = []
    total = 1
    for _, (_, shape) in checkpoint.items():
        n = 1
        for d in shape:
            n *= int(d)
        total += n
    # int32 proxies when every global index fits (half the memory and time)
    idx_dtype = torch.int32 if total < 2**31 else torch.int64
    try:
        for name, p in params.items():
            swapped[name] = p.data
            p.data = torch.zeros(p.shape, dtype=idx_dtype)

        def probes() -> Iterable[Tuple[str, Any]]:
            base = 1
            for cname, (_, shape) in checkpoint.items():
                n = 1
                for d in shape:
                    n *= int(d)
                bases.append((base, cname, n))
                yield cname, torch.arange(base, base + n, dtype=idx_dtype).view(*shape)
                base += n

        loader(probes())
        starts = torch.tensor([b[0] for b in bases], dtype=torch.int64)
        for pname, p in params.items():
            if _rows(p.data, pname, bases, starts, mapping):
                continue
            flat = p.data.view(-1)
            hit = (flat > 0).nonzero().flatten()
            mapping.unmapped[pname] = flat.numel() - hit.numel()
            if hit.numel() == 0:
                continue
            vals = flat[hit].to(torch.int64)
            if int(vals.max()) >= total:
                raise Unmappable(
                    f"parameter `{pname}`: the loader wrote values that are not checkpoint "
                    "elements (a transform at load); follow this model with the engine's reload"
                )
            which = torch.searchsorted(starts, vals, right=True) - 1
            for t in torch.unique(which).tolist():
                base, cname, _ = bases[t]
                sel = (which == t).nonzero().flatten()
                cs, ps, ln = _runs(vals[sel] - base, hit[sel])
                mapping.tensors.setdefault(cname, []).append(Runs(pname, cs, ps, ln))
        # A checkpoint element lands at most once on a rank (runs of one
        # tensor do not overlap), or the patch could not be placed.
        for cname, runs in mapping.tensors.items():
            cs = torch.cat([r.ckpt_start for r in runs])
            ln = torch.cat([r.length for r in runs])
            order = torch.argsort(cs)
            cs, ln = cs[order], ln[order]
            if cs.numel() > 1 and bool(((cs[:-1] + ln[:-1]) > cs[1:]).any()):
                raise Unmappable(
                    f"checkpoint tensor `{cname}` lands twice on this rank (a loader that "
                    "replicates within a rank); follow this model with the engine's reload"
                )
    finally:
        for name, p in params.items():
            if name in swapped:
                p.data = swapped[name]
    return mapping


def copy_runs(dst: Any, src: Any, r: Runs) -> None:
    """Copies the checkpoint elements of ``r`` from ``src`` (the checkpoint
    tensor's flat words) into ``dst`` (the parameter's flat words): one
    strided copy when the runs are regular (rows of a shard: equal lengths,
    evenly spaced on both sides), else one copy per run."""
    torch = _torch()
    if r.length.numel() == 0:
        return
    if r.grid is not None:  # regular runs (found once, when the runs were made)
        c0, sstride, p0, dstride, L, k = r.grid
        if sstride == L and dstride == L:  # one stretch on both sides
            dst[p0: p0 + k * L].copy_(src[c0: c0 + k * L])
            return
        d = torch.as_strided(dst, (k, L), (dstride, 1), p0)
        s = torch.as_strided(src, (k, L), (sstride, 1), c0)
        d.copy_(s)
        return
    for c, p, n in zip(r.ckpt_start.tolist(), r.param_start.tolist(), r.length.tolist()):
        dst[p: p + n].copy_(src[c: c + n])
