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

    def elements(self) -> int:
        return int(self.length.sum())


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
        torch = _torch()
        out = []
        for r in self.tensors.get(tensor, []):
            k = torch.searchsorted(r.ckpt_start, positions, right=True) - 1
            valid = k >= 0
            kc = k.clamp(min=0)
            off = positions - r.ckpt_start[kc]
            valid &= off < r.length[kc]
            idx = valid.nonzero().flatten()
            if idx.numel():
                out.append((r.param, (r.param_start[kc[idx]] + off[idx]), idx))
        return out


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
    try:
        for name, p in params.items():
            swapped[name] = p.data
            p.data = torch.zeros(p.shape, dtype=torch.int64)

        def probes() -> Iterable[Tuple[str, Any]]:
            base = 1
            for cname, (_, shape) in checkpoint.items():
                n = 1
                for d in shape:
                    n *= int(d)
                bases.append((base, cname, n))
                yield cname, torch.arange(base, base + n, dtype=torch.int64).view(*shape)
                base += n

        loader(probes())
        starts = torch.tensor([b[0] for b in bases], dtype=torch.int64)
        for pname, p in params.items():
            flat = p.data.view(-1)
            hit = (flat > 0).nonzero().flatten()
            mapping.unmapped[pname] = flat.numel() - hit.numel()
            if hit.numel() == 0:
                continue
            vals = flat[hit]
            end = bases[-1][0] + bases[-1][2] if bases else 1
            if int(vals.max()) >= end:
                raise Unmappable(
                    f"parameter `{pname}`: the loader wrote values that are not checkpoint "
                    "elements (a transform at load); follow this model with the engine's reload"
                )
            if torch.unique(vals).numel() != vals.numel():
                raise Unmappable(
                    f"parameter `{pname}`: a checkpoint element lands twice in it; follow this "
                    "model with the engine's reload"
                )
            which = torch.searchsorted(starts, vals, right=True) - 1
            for t in torch.unique(which).tolist():
                base, cname, _ = bases[t]
                sel = (which == t).nonzero().flatten()
                cs, ps, ln = _runs(vals[sel] - base, hit[sel])
                mapping.tensors.setdefault(cname, []).append(Runs(pname, cs, ps, ln))
    finally:
        for name, p in params.items():
            if name in swapped:
                p.data = swapped[name]
    return mapping
