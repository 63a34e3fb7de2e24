#!/usr/bin/env python3
"""A reference implementation of Hugging Face TRL's "delta weight sync" format.

Written from the format's description (/work/shared/research/trl.md §1, TRL PRs
#5417 and #5937), independently of weightcast's Rust code: numpy plus its own
small safetensors reader and writer. bf16 tensors are carried as their uint16
bit patterns (numpy has no bf16); nothing here does float arithmetic on them.

Commands (each prints one JSON line):

  write-bucket DIR --generation v1|v3 [--encoding raw|gap_delta] --steps N
               --anchor-every K --seed S --expected OUT.safetensors
      A bucket as TRL's trainer writes it: anchors/step_{step:06}.safetensors at
      step 1 and every multiple of K (complete, as v3 writes them), deltas at
      the other steps. OUT is the model at the last step.
  write-delta --generation v1|v3 [--encoding raw|gap_delta] --seed S
              --base BASE.safetensors --delta D.safetensors --expected NEW.safetensors
      One TRL delta from the model at step 1 (BASE) to step 2 (NEW).
  read-bucket DIR --out OUT.safetensors
      TRL's receiver logic: the newest anchor, then every delta after it in
      step order (weightcast.* keys are ignored). OUT is the result.
  read-file FILE [--base BASE.safetensors --out OUT.safetensors]
      Describes one anchor or delta; with --base, applies the delta to it.

The model is transformer-shaped bf16 (embeddings, two layers of q/k/v/o and an
MLP, norms, lm_head; ~1.8 M elements, values ~N(0, 0.02)). Each step changes
~1-2% of a parameter's elements by +-1 or 2 ulp; the embedding changes only in
two rows far apart (a gap_delta gap over 0xFFFF: U32 indices); the final norm
is unchanged at step 2 and a layer norm at step 5 (v3: empty .idx/.val pairs);
step 4 changes nothing (v3: no file; v1: a delta without tensors).
"""

import argparse
import json
import os
import re
import struct
import sys

import numpy as np

# ---------------------------------------------------------------------------
# safetensors, by hand: u64 LE header length, JSON header, data.

DTYPES = {
    "BF16": np.dtype("<u2"),  # bit patterns
    "F16": np.dtype("<f2"),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "I32": np.dtype("<i4"),
    "I64": np.dtype("<i8"),
    "U8": np.dtype("u1"),
    "U16": np.dtype("<u2"),
    "U32": np.dtype("<u4"),
}


class Tensor:
    def __init__(self, dtype, array):
        assert dtype in DTYPES, dtype
        self.dtype = dtype
        self.array = np.ascontiguousarray(array, dtype=DTYPES[dtype])


def write_safetensors(path, tensors, metadata):
    """tensors: dict name -> Tensor, written in sorted name order."""
    header = {}
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    offset = 0
    names = sorted(tensors)
    for name in names:
        t = tensors[name]
        n = t.array.nbytes
        header[name] = {
            "dtype": t.dtype,
            "shape": list(t.array.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in names:
            f.write(tensors[name].array.tobytes())
    os.replace(tmp, path)


def read_safetensors(path):
    """Returns (metadata dict, dict name -> Tensor); checks the container."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise ValueError(f"{path}: shorter than 8 bytes")
    (n,) = struct.unpack("<Q", data[:8])
    if n > 100_000_000 or 8 + n > len(data):
        raise ValueError(f"{path}: header length {n} is impossible")
    header = json.loads(data[8 : 8 + n].decode())
    metadata = header.pop("__metadata__", {}) or {}
    body = data[8 + n :]
    tensors = {}
    spans = []
    for name, info in header.items():
        dtype = info["dtype"]
        if dtype not in DTYPES:
            raise ValueError(f"{path}: tensor {name}: dtype {dtype} not handled")
        shape = tuple(info["shape"])
        a, b = info["data_offsets"]
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if b - a != count * DTYPES[dtype].itemsize or not 0 <= a <= b <= len(body):
            raise ValueError(f"{path}: tensor {name}: offsets do not match dtype and shape")
        spans.append((a, b))
        arr = np.frombuffer(body[a:b], dtype=DTYPES[dtype]).reshape(shape)
        tensors[name] = Tensor(dtype, arr.copy())
    spans.sort()
    at = 0
    for a, b in spans:
        if a != at:
            raise ValueError(f"{path}: tensor data has a hole or an overlap at {at}")
        at = b
    if at != len(body):
        raise ValueError(f"{path}: {len(body) - at} bytes after the last tensor")
    return metadata, tensors


# ---------------------------------------------------------------------------
# The model and its training steps.

HIDDEN, KV, INTER, VOCAB, LAYERS = 256, 128, 512, 1024, 2
EMBED = "model.embed_tokens.weight"
UNCHANGED = {2: "model.norm.weight", 5: "model.layers.1.input_layernorm.weight"}
NO_CHANGE_STEP = 4


def shapes():
    out = [(EMBED, (VOCAB, HIDDEN))]
    for l in range(LAYERS):
        p = f"model.layers.{l}"
        out += [
            (f"{p}.input_layernorm.weight", (HIDDEN,)),
            (f"{p}.self_attn.q_proj.weight", (HIDDEN, HIDDEN)),
            (f"{p}.self_attn.k_proj.weight", (KV, HIDDEN)),
            (f"{p}.self_attn.v_proj.weight", (KV, HIDDEN)),
            (f"{p}.self_attn.o_proj.weight", (HIDDEN, HIDDEN)),
            (f"{p}.post_attention_layernorm.weight", (HIDDEN,)),
            (f"{p}.mlp.gate_proj.weight", (INTER, HIDDEN)),
            (f"{p}.mlp.up_proj.weight", (INTER, HIDDEN)),
            (f"{p}.mlp.down_proj.weight", (HIDDEN, INTER)),
        ]
    out += [("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))]
    return out


def to_bf16(x):
    """float32 -> bf16 bit patterns, round to nearest even."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def initial_model(rng):
    model = {}
    for name, shape in shapes():
        if name.endswith("norm.weight"):
            x = 1.0 + rng.normal(0.0, 0.05, shape)
        else:
            x = rng.normal(0.0, 0.02, shape)
        model[name] = to_bf16(x)
    return model


def nudge(bits, mask, rng):
    """Moves the masked bf16 values by +-1 or 2 ulp (magnitude steps)."""
    flat = bits.reshape(-1).copy()
    pos = np.flatnonzero(mask.reshape(-1))
    steps = rng.choice(np.array([-2, -1, -1, 1, 1, 2]), size=pos.size)
    mag = (flat[pos] & 0x7FFF).astype(np.int64)
    new = mag + steps
    bad = (new < 1) | (new > 0x7F7F)  # keep away from zero crossings and inf/NaN
    new[bad] = mag[bad] - steps[bad]
    flat[pos] = (flat[pos] & 0x8000) | new.astype(np.uint16)
    return flat.reshape(bits.shape)


def train_step(model, step, rng):
    """The model after `step` (>= 2). Deterministic in the rng's state, so a
    longer run repeats a shorter one's steps exactly."""
    new = {}
    for name, shape in shapes():
        old = model[name]
        # Draw for every parameter at every step, so the stream does not depend
        # on which parameters change.
        density = rng.uniform(0.01, 0.02)
        noise = rng.random(old.size).reshape(shape)
        rows = rng.choice(VOCAB // 2, size=1)[0]
        if step == NO_CHANGE_STEP or UNCHANGED.get(step) == name:
            new[name] = old.copy()
            continue
        if name == EMBED:
            # Gradients reach only the rows of the tokens seen: two rows, 400
            # apart, so the gap between them exceeds 0xFFFF elements.
            mask = np.zeros(shape, dtype=bool)
            for r in (rows, rows + 400):
                mask[r] = noise[r] < 0.3
        else:
            mask = noise < density
        new[name] = nudge(old, mask, rng)
    return new


def models(seed, steps):
    """[model at step 1, model at step 2, ...]."""
    rng = np.random.default_rng(seed)
    out = [initial_model(rng)]
    for step in range(2, steps + 1):
        out.append(train_step(out[-1], step, rng))
    return out


# ---------------------------------------------------------------------------
# TRL's writer (PatchMetadata: every value a Python str()).


def gap_delta_encode(idx):
    """idx[k] - idx[k-1] - 1 with idx[-1] = -1; uint16 if every gap fits, else uint32."""
    idx = idx.astype(np.int64)
    if idx.size == 0:
        return "U16", idx.astype(np.uint16)
    prev = np.concatenate([np.array([-1], dtype=np.int64), idx[:-1]])
    gaps = idx - prev - 1
    if int(gaps.max()) <= 0xFFFF:
        return "U16", gaps.astype(np.uint16)
    return "U32", gaps.astype(np.uint32)


def gap_delta_decode(gaps):
    if gaps.size == 0:
        return gaps.astype(np.int64)
    return np.cumsum(gaps.astype(np.int64) + 1) - 1


def metadata(generation, encoding, sparse, step, names, changed, total):
    meta = {
        "format": "sparse_weight_patch",
        "version": "1",
        "sparse": str(sparse),
        "model_version": str(step),
        "num_changed_params": str(len(names)),
        "total_changed_elements": str(changed),
        "total_elements": str(total),
        "sparsity": str(1.0 - changed / max(total, 1)),
    }
    if generation == "v1":
        meta["changed_params"] = json.dumps(names)
    else:
        meta["encoding"] = encoding
    return meta


def anchor_object(model, step, generation, encoding):
    tensors = {n: Tensor("BF16", a) for n, a in model.items()}
    total = sum(a.size for a in model.values())
    names = sorted(model)
    return tensors, metadata(generation, encoding, False, step, names, total, total)


def delta_object(old, new, step, generation, encoding):
    """The delta old -> new as TRL writes it; None when v3 writes no file."""
    tensors = {}
    names = []
    changed = total = 0
    for name in sorted(new):
        idx = np.flatnonzero(old[name].reshape(-1) != new[name].reshape(-1))
        if generation == "v1" and idx.size == 0:
            continue  # v1: only the parameters whose mask has a change
        names.append(name)
        changed += idx.size
        total += new[name].size
        values = new[name].reshape(-1)[idx]
        if generation == "v1":
            tensors[name + ".indices"] = Tensor("I32", idx.astype(np.int32))
            tensors[name + ".values"] = Tensor("BF16", values)
        else:
            if encoding == "raw":
                tensors[name + ".idx"] = Tensor("I32", idx.astype(np.int32))
            else:
                dt, gaps = gap_delta_encode(idx)
                tensors[name + ".idx"] = Tensor(dt, gaps)
            tensors[name + ".val"] = Tensor("BF16", values)
    if generation == "v3" and changed == 0:
        return None  # TRL v3: a step without changes writes no file
    return tensors, metadata(generation, encoding, True, step, names, changed, total)


def plain(model):
    return {n: Tensor("BF16", a) for n, a in model.items()}


# ---------------------------------------------------------------------------
# TRL's receiver.

KEY = re.compile(r"^step_(\d{6,})\.safetensors$")


def steps_in(folder):
    out = {}
    if os.path.isdir(folder):
        for f in os.listdir(folder):
            m = KEY.match(f)
            if m and f"{int(m.group(1)):06d}" == m.group(1):
                out[int(m.group(1))] = os.path.join(folder, f)
    return out


def load_anchor(path, step):
    meta, tensors = read_safetensors(path)
    if meta.get("format") != "sparse_weight_patch" or meta.get("sparse") != "False":
        raise ValueError(f"{path}: not a TRL anchor (format/sparse)")
    if "model_version" in meta and int(meta["model_version"]) != step:
        raise ValueError(f"{path}: model_version {meta['model_version']} is not step {step}")
    if int(meta.get("num_changed_params", len(tensors))) != len(tensors):
        raise ValueError(f"{path}: num_changed_params disagrees with the tensors")
    return {n: t for n, t in tensors.items()}


def patches(meta, tensors, path):
    """(name, int64 positions, values Tensor) per parameter of a delta file."""
    v3 = any(k.endswith(".idx") or k.endswith(".val") for k in tensors)
    out = []
    if v3:
        encoding = meta.get("encoding", "gap_delta")
        names = sorted({k[: -len(".val")] for k in tensors if k.endswith(".val")})
        for name in names:
            idx = tensors[name + ".idx"]
            if encoding == "raw":
                if idx.dtype != "I32":
                    raise ValueError(f"{path}: {name}: raw indices are {idx.dtype}")
                pos = idx.array.astype(np.int64)
            elif encoding == "gap_delta":
                if idx.dtype not in ("U16", "U32"):
                    raise ValueError(f"{path}: {name}: gap_delta indices are {idx.dtype}")
                pos = gap_delta_decode(idx.array)
            else:
                raise ValueError(f"{path}: index encoding {encoding} needs nvCOMP on a GPU")
            out.append((name, pos, tensors[name + ".val"]))
        expect = 2 * len(names)
    else:
        names = json.loads(meta["changed_params"]) if "changed_params" in meta else sorted(
            k[: -len(".values")] for k in tensors if k.endswith(".values")
        )
        for name in names:
            idx = tensors[name + ".indices"]
            if idx.dtype not in ("I32", "I64"):
                raise ValueError(f"{path}: {name}: indices are {idx.dtype}")
            out.append((name, idx.array.astype(np.int64), tensors[name + ".values"]))
        expect = 2 * len(names)
    if len(tensors) != expect:
        raise ValueError(f"{path}: {len(tensors)} tensors, {expect} expected")
    if "total_changed_elements" in meta:
        got = sum(p.size for _, p, _ in out)
        if int(meta["total_changed_elements"]) != got:
            raise ValueError(f"{path}: total_changed_elements disagrees ({got})")
    return out


def apply_delta(state, path, step=None):
    meta, tensors = read_safetensors(path)
    if meta.get("format") != "sparse_weight_patch" or meta.get("sparse") != "True":
        raise ValueError(f"{path}: not a TRL delta (format/sparse)")
    if step is not None and "model_version" in meta and int(meta["model_version"]) != step:
        raise ValueError(f"{path}: model_version {meta['model_version']} is not step {step}")
    for name, pos, val in patches(meta, tensors, path):
        if name not in state:
            raise ValueError(f"{path}: {name} is not in the state")
        target = state[name]
        if val.dtype != target.dtype or val.array.ndim != 1 or pos.ndim != 1:
            raise ValueError(f"{path}: {name}: values {val.dtype} for a {target.dtype} parameter")
        if pos.size != val.array.size:
            raise ValueError(f"{path}: {name}: {pos.size} indices, {val.array.size} values")
        if pos.size and (pos[0] < 0 or np.any(np.diff(pos) <= 0) or pos[-1] >= target.array.size):
            raise ValueError(f"{path}: {name}: indices not ascending or out of range")
        flat = target.array.reshape(-1).copy()
        flat[pos] = val.array
        state[name] = Tensor(target.dtype, flat.reshape(target.array.shape))
    return meta


def read_bucket(folder):
    anchors = steps_in(os.path.join(folder, "anchors"))
    if not anchors:
        raise ValueError(f"{folder}: no anchor")
    start = max(anchors)
    state = load_anchor(anchors[start], start)
    deltas = steps_in(os.path.join(folder, "deltas"))
    applied = []
    for step in sorted(s for s in deltas if s > start):
        apply_delta(state, deltas[step], step)
        applied.append(step)
    return state, start, applied


# ---------------------------------------------------------------------------


def encoding_of(args):
    return args.encoding if args.generation == "v3" else None


def cmd_write_bucket(args):
    os.makedirs(os.path.join(args.dir, "anchors"), exist_ok=True)
    os.makedirs(os.path.join(args.dir, "deltas"), exist_ok=True)
    ms = models(args.seed, args.steps)
    written = []
    for step in range(1, args.steps + 1):
        model = ms[step - 1]
        if step == 1 or step % args.anchor_every == 0:
            t, meta = anchor_object(model, step, args.generation, encoding_of(args))
            key = f"anchors/step_{step:06d}.safetensors"
        else:
            obj = delta_object(ms[step - 2], model, step, args.generation, encoding_of(args))
            if obj is None:
                continue
            t, meta = obj
            key = f"deltas/step_{step:06d}.safetensors"
        write_safetensors(os.path.join(args.dir, key), t, meta)
        written.append(key)
    write_safetensors(args.expected, plain(ms[-1]), {"format": "pt"})
    print(json.dumps({"written": written, "steps": args.steps}))


def cmd_write_delta(args):
    m1, m2 = models(args.seed, 2)
    t, meta = delta_object(m1, m2, 2, args.generation, encoding_of(args))
    write_safetensors(args.base, plain(m1), {"format": "pt"})
    write_safetensors(args.delta, t, meta)
    write_safetensors(args.expected, plain(m2), {"format": "pt"})
    widths = sorted({x.dtype for k, x in t.items() if k.endswith((".idx", ".indices"))})
    print(json.dumps({"params": int(meta["num_changed_params"]), "index_dtypes": widths}))


def cmd_read_bucket(args):
    state, start, applied = read_bucket(args.dir)
    write_safetensors(args.out, state, {"format": "pt"})
    last = applied[-1] if applied else start
    print(json.dumps({"anchor": start, "deltas": applied, "step": last}))


def cmd_read_file(args):
    meta, tensors = read_safetensors(args.file)
    info = {"metadata": {k: v for k, v in meta.items() if not k.startswith("weightcast.")}}
    if meta.get("sparse") == "True":
        info["params"] = [n for n, _, _ in patches(meta, tensors, args.file)]
        if args.base:
            _, base = read_safetensors(args.base)
            apply_delta(base, args.file)
            if args.out:
                write_safetensors(args.out, base, {"format": "pt"})
    else:
        info["params"] = sorted(tensors)
    print(json.dumps(info))


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    def layout(s):
        s.add_argument("--generation", choices=["v1", "v3"], required=True)
        s.add_argument("--encoding", choices=["raw", "gap_delta"], default="gap_delta")
        s.add_argument("--seed", type=int, default=0)

    s = sub.add_parser("write-bucket")
    s.add_argument("dir")
    layout(s)
    s.add_argument("--steps", type=int, default=5)
    s.add_argument("--anchor-every", type=int, default=3)
    s.add_argument("--expected", required=True)
    s.set_defaults(run=cmd_write_bucket)

    s = sub.add_parser("write-delta")
    layout(s)
    s.add_argument("--base", required=True)
    s.add_argument("--delta", required=True)
    s.add_argument("--expected", required=True)
    s.set_defaults(run=cmd_write_delta)

    s = sub.add_parser("read-bucket")
    s.add_argument("dir")
    s.add_argument("--out", required=True)
    s.set_defaults(run=cmd_read_bucket)

    s = sub.add_parser("read-file")
    s.add_argument("file")
    s.add_argument("--base")
    s.add_argument("--out")
    s.set_defaults(run=cmd_read_file)

    args = p.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main(sys.argv[1:])
