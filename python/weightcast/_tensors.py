"""Tensors between Python and the library: dtypes, lending memory, words.

numpy arrays and CPU torch tensors are lent to the Rust side without a copy:
their address and size are read here, after checking that the memory is one
C-contiguous block on the CPU, and the native call uses them only while it
runs (the caller's references keep them alive). Tensors on another device
(CUDA) never reach Rust: they are gathered from and scattered to with torch
ops (see ``Update.apply_to``).
"""

from __future__ import annotations

import sys
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np

from ._errors import BadRequest

# (name, safetensors dtype, shape, address, bytes)
Spec = Tuple[str, str, List[int], int, int]

# Dtype names numpy and torch share, and their safetensors names.
_COMMON_DTYPES = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "int16": "I16",
    "uint16": "U16",
    "float16": "F16",
    "bfloat16": "BF16",
    "int32": "I32",
    "uint32": "U32",
    "float32": "F32",
    "complex64": "C64",
    "float64": "F64",
    "int64": "I64",
    "uint64": "U64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "float8_e8m0fnu": "F8_E8M0",
}
# numpy: bfloat16 and the float8 types when ml_dtypes' extension types are used
_NUMPY_DTYPES = dict(_COMMON_DTYPES)
_TORCH_DTYPES = dict(_COMMON_DTYPES)

# Bytes per element of every safetensors dtype that has whole bytes; the
# packed ones (F4, F6_*) are lent as raw bytes only (see Raw).
_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "F8_E4M3FNUZ": 1, "F8_E5M2FNUZ": 1, "I16": 2, "U16": 2, "F16": 2,
    "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "C64": 8, "F64": 8, "I64": 8,
    "U64": 8,
}

# Unsigned integer words of each width, to move a tensor's words around
# without interpreting them.
_WORDS_NUMPY = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class Raw:
    """Bytes of a tensor whose dtype numpy cannot express (bf16 without
    ``ml_dtypes``, FP8, the packed F4/F6 types): ``data`` is a C-contiguous
    numpy array holding them (any integer dtype), ``dtype`` the safetensors
    dtype name and ``shape`` the tensor's shape.

    >>> Raw(np.zeros(4, dtype=np.uint16), "BF16", (2, 2))
    """

    __slots__ = ("data", "dtype", "shape")

    def __init__(self, data: np.ndarray, dtype: str, shape: Optional[Tuple[int, ...]] = None):
        if not isinstance(data, np.ndarray):
            raise BadRequest("Raw wraps a numpy array")
        self.data = data
        self.dtype = dtype
        self.shape = tuple(data.shape if shape is None else shape)

    def __repr__(self) -> str:
        return f"Raw({self.dtype}, shape={self.shape})"


def _torch():
    """torch if the process imported it (a caller passing torch tensors has)."""
    return sys.modules.get("torch")


def is_torch(x: Any) -> bool:
    t = _torch()
    return t is not None and isinstance(x, t.Tensor)


def on_cpu(x: Any) -> bool:
    return not is_torch(x) or x.device.type == "cpu"


def dtype_of(name: str, x: Any) -> str:
    """The safetensors dtype of a tensor, array or Raw."""
    if isinstance(x, Raw):
        return x.dtype
    if is_torch(x):
        key = str(x.dtype).replace("torch.", "")
        table = _TORCH_DTYPES
    elif isinstance(x, np.ndarray):
        if x.dtype.byteorder == ">":
            raise BadRequest(f"tensor `{name}`: big-endian arrays are not supported; "
                             "convert with .astype(dtype.newbyteorder('<'))")
        key = x.dtype.name
        table = _NUMPY_DTYPES
    else:
        raise BadRequest(f"tensor `{name}`: a {type(x).__name__} is not a torch tensor, "
                         "numpy array or weightcast.Raw")
    try:
        return table[key]
    except KeyError:
        raise BadRequest(f"tensor `{name}`: dtype {key} has no safetensors equivalent; "
                         "pass its bytes as weightcast.Raw(array, DTYPE)") from None


def shape_of(x: Any) -> List[int]:
    return [int(d) for d in (x.shape if not is_torch(x) else x.shape)]


def lend(name: str, x: Any, *, write: bool) -> Tuple[Spec, Any]:
    """Describes a CPU tensor's memory for the native side; returns the
    description and the object that owns the memory (keep it alive for the
    call). Reading accepts non-contiguous tensors (copied); writing needs
    the tensor's own memory."""
    dtype = dtype_of(name, x)
    if isinstance(x, Raw):
        arr = x.data
        shape = list(x.shape)
    elif is_torch(x):
        if x.device.type != "cpu":
            raise BadRequest(f"tensor `{name}` is on {x.device}; copy it to the CPU first")
        t = x.detach()
        if not t.is_contiguous():
            if write:
                raise BadRequest(f"tensor `{name}` is not contiguous; weightcast patches a "
                                 "tensor's own memory (pass .contiguous() tensors you keep)")
            t = t.contiguous()
        nbytes = t.numel() * t.element_size()
        return (name, dtype, shape_of(t), t.data_ptr() if nbytes else 0, nbytes), t
    elif isinstance(x, np.ndarray):
        arr = x
        shape = shape_of(x)
    else:
        raise BadRequest(f"tensor `{name}`: unsupported type {type(x).__name__}")
    if not arr.flags.c_contiguous:
        if write:
            raise BadRequest(f"tensor `{name}` is not C-contiguous; weightcast patches an "
                             "array's own memory")
        arr = np.ascontiguousarray(arr)
    if write and not arr.flags.writeable:
        raise BadRequest(f"tensor `{name}` is read-only")
    nbytes = int(arr.nbytes)
    ptr = int(arr.__array_interface__["data"][0]) if nbytes else 0
    return (name, dtype, shape, ptr, nbytes), arr


def _storage(x: Any) -> Optional[Tuple[Any, ...]]:
    """What identifies a tensor's memory (address, bytes, device, dtype,
    shape), or None for an empty one."""
    if isinstance(x, Raw):
        x = x.data
    if is_torch(x):
        n = x.numel() * x.element_size()
        return (x.data_ptr(), n, str(x.device), str(x.dtype), tuple(x.shape)) if n else None
    if isinstance(x, np.ndarray) and x.nbytes:
        return (int(x.__array_interface__["data"][0]), int(x.nbytes), "cpu", str(x.dtype),
                tuple(x.shape))
    return None


def untie(tensors: Mapping[str, Any], prefer: Any = ()) -> Tuple[Dict[str, Any], Dict[str, str]]:
    """``tensors`` with one name per storage: names that are the very same
    memory (tied weights, e.g. ``lm_head.weight`` and
    ``model.embed_tokens.weight``) keep one name — one in ``prefer`` when
    there is one, else the first in order. Returns the mapping and
    ``{dropped: kept}``. Writing the kept name writes every name of its
    storage."""
    kept: Dict[Tuple[Any, ...], str] = {}
    out: Dict[str, Any] = {}
    aliases: Dict[str, str] = {}
    for name, t in tensors.items():
        key = _storage(t)
        if key is None or key not in kept:
            if key is not None:
                kept[key] = name
            out[name] = t
            continue
        first = kept[key]
        if name in prefer and first not in prefer:
            del out[first]
            aliases[first] = name
            kept[key] = name
            out[name] = t
        else:
            aliases[name] = first
    return out, aliases


def lend_all(tensors: Mapping[str, Any], *, write: bool) -> Tuple[List[Spec], List[Any]]:
    specs, keep = [], []
    for name, x in tensors.items():
        spec, owner = lend(str(name), x, write=write)
        specs.append(spec)
        keep.append(owner)
    return specs, keep


def word_view(name: str, x: Any, word_bytes: int):
    """A flat view of a tensor's words (unsigned integers of ``word_bytes``
    bytes) sharing its memory: for torch tensors on any device, and numpy
    arrays."""
    if is_torch(x):
        torch = _torch()
        if not x.is_contiguous():
            raise BadRequest(f"tensor `{name}` is not contiguous; weightcast patches a "
                             "tensor's own memory")
        words = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[word_bytes]
        flat = x.detach().reshape(-1)
        if flat.element_size() != word_bytes or flat.dtype != words:
            flat = flat.view(torch.uint8).view(words)
        return flat
    arr = x.data if isinstance(x, Raw) else x
    if not arr.flags.c_contiguous:
        raise BadRequest(f"tensor `{name}` is not C-contiguous")
    return arr.reshape(-1).view(np.uint8).view(_WORDS_NUMPY[word_bytes])


def from_bytes(buf: bytearray, dtype: str, shape: List[int], prefer_torch: bool):
    """A tensor over ``buf`` (no copy): torch when wanted and available, else
    numpy (a dtype numpy lacks comes back as weightcast.Raw)."""
    torch = _torch() if prefer_torch else None
    if torch is not None:
        inv = {v: k for k, v in _TORCH_DTYPES.items()}
        td = getattr(torch, inv.get(dtype, ""), None)
        if td is not None:
            if len(buf) == 0:
                return torch.empty(shape, dtype=td)
            return torch.frombuffer(buf, dtype=torch.uint8).view(td).reshape(shape)
    inv = {v: k for k, v in _NUMPY_DTYPES.items()}
    try:
        nd = np.dtype(inv[dtype])
    except (KeyError, TypeError):
        width = _DTYPE_BYTES.get(dtype)
        raw = np.frombuffer(buf, dtype=_WORDS_NUMPY[width] if width else np.uint8)
        return Raw(raw.copy() if width else raw, dtype, tuple(shape))
    return np.frombuffer(buf, dtype=nd).reshape(shape)


def group_files(tensors: Mapping[str, Any], file_name: str) -> Dict[str, Mapping[str, Any]]:
    """``{name: tensor}`` as one tensor file, or ``{file: {name: tensor}}``
    (a sharded checkpoint) as it is."""
    if not tensors:
        raise BadRequest("no tensors to publish")
    nested = [isinstance(v, Mapping) for v in tensors.values()]
    if all(nested):
        return dict(tensors)
    if any(nested):
        raise BadRequest("pass either {name: tensor} or {file: {name: tensor}}, not a mix")
    return {file_name: tensors}
