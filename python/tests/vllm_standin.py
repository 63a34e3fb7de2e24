"""A tensor-parallel engine in vLLM's layout, for tests on CPU.

vLLM serves only on GPUs, so the tests follow its parameter layout with
stand-ins of its layers, written from vLLM's (and SGLang's, adapted from
vLLM) ``vllm/model_executor/layers/linear.py``,
``vocab_parallel_embedding.py`` and ``fused_moe/layer.py``, and of a model's
``load_weights`` (``vllm/model_executor/models/llama.py``,
``mixtral.py``): the weight loaders below place checkpoint tensors the way
vLLM's do —

- ``QKVParallelLinear``: q/k/v fused along the output dimension, each rank
  holding its query heads and its key/value heads (replicated when there are
  fewer KV heads than ranks: rank ``r`` holds KV head ``r // replicas``);
- ``MergedColumnParallelLinear``: gate and up fused, each rank's slice of
  each;
- ``RowParallelLinear``: a slice of the input dimension;
- ``VocabParallelEmbedding`` / ``ParallelLMHead``: the vocabulary padded to
  a multiple of 64 and split in equal ranges, the padding zero-filled;
- ``FusedMoE``: experts stacked into ``w13_weight`` [E, 2·I/tp, H] (gate
  then up) and ``w2_weight`` [E, H, I/tp];
- a model's ``load_weights`` with the ``stacked_params_mapping`` and the
  expert mapping, renaming checkpoint names to parameter names.

What is not reproduced: the kernels (forward passes are not needed), the
quantized parameter classes, and vLLM's process-group setup (rank and world
size are arguments here).
"""

from __future__ import annotations

from typing import Iterable, List, Tuple

import torch
from torch import nn

PAD = 64


def _param(shape, dtype, **attrs):
    p = nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
    for k, v in attrs.items():
        setattr(p, k, v)
    return p


def default_weight_loader(param, loaded):
    assert param.size() == loaded.size(), (param.size(), loaded.size())
    param.data.copy_(loaded)


class ColumnParallelLinear(nn.Module):
    def __init__(self, inp, out, tp, rank, dtype):
        super().__init__()
        self.tp, self.rank = tp, rank
        self.weight = _param((out // tp, inp), dtype, output_dim=0, weight_loader=self.weight_loader)

    def weight_loader(self, param, loaded):
        size = param.data.shape[0]
        param.data.copy_(loaded.narrow(0, self.rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    def __init__(self, inp, output_sizes: List[int], tp, rank, dtype):
        super().__init__(inp, sum(output_sizes), tp, rank, dtype)
        self.output_sizes = output_sizes

    def weight_loader(self, param, loaded, loaded_shard_id: int):
        offset = sum(self.output_sizes[:loaded_shard_id]) // self.tp
        size = self.output_sizes[loaded_shard_id] // self.tp
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    def __init__(self, hidden, head_size, total_heads, total_kv_heads, tp, rank, dtype):
        self.head_size = head_size
        self.num_heads = total_heads // tp
        if tp >= total_kv_heads:
            self.num_kv_heads, self.num_kv_head_replicas = 1, tp // total_kv_heads
        else:
            self.num_kv_heads, self.num_kv_head_replicas = total_kv_heads // tp, 1
        out = (self.num_heads + 2 * self.num_kv_heads) * tp * head_size
        super().__init__(hidden, out, tp, rank, dtype)

    def weight_loader(self, param, loaded, loaded_shard_id: str):
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_size
        offset, size = {"q": (0, nh * hd), "k": (nh * hd, nkv * hd),
                        "v": ((nh + nkv) * hd, nkv * hd)}[loaded_shard_id]
        shard = self.rank if loaded_shard_id == "q" else self.rank // self.num_kv_head_replicas
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, shard * size, size))


class RowParallelLinear(nn.Module):
    def __init__(self, inp, out, tp, rank, dtype):
        super().__init__()
        self.rank = rank
        self.weight = _param((out, inp // tp), dtype, input_dim=1, weight_loader=self.weight_loader)

    def weight_loader(self, param, loaded):
        size = param.data.shape[1]
        param.data.copy_(loaded.narrow(1, self.rank * size, size))


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab, hidden, tp, rank, dtype):
        super().__init__()
        padded = (vocab + PAD - 1) // PAD * PAD
        self.per = padded // tp
        self.start = rank * self.per
        self.end = min(self.start + self.per, vocab)
        self.weight = _param((self.per, hidden), dtype, output_dim=0,
                             weight_loader=self.weight_loader)

    def weight_loader(self, param, loaded):
        n = max(self.end - self.start, 0)
        param[:n].data.copy_(loaded[self.start: self.start + n])
        param[n:].data.fill_(0)


class ParallelLMHead(VocabParallelEmbedding):
    pass


class RMSNorm(nn.Module):
    def __init__(self, hidden, dtype):
        super().__init__()
        self.weight = _param((hidden,), dtype)


class FusedMoE(nn.Module):
    def __init__(self, experts, hidden, inter, tp, rank, dtype):
        super().__init__()
        self.rank, self.i = rank, inter // tp
        self.w13_weight = _param((experts, 2 * self.i, hidden), dtype,
                                 weight_loader=self.weight_loader)
        self.w2_weight = _param((experts, hidden, self.i), dtype,
                                weight_loader=self.weight_loader)

    def weight_loader(self, param, loaded, weight_name, shard_id, expert_id):
        e = param.data[expert_id]
        if shard_id == "w1":
            e.narrow(0, 0, self.i).copy_(loaded.narrow(0, self.rank * self.i, self.i))
        elif shard_id == "w3":
            e.narrow(0, self.i, self.i).copy_(loaded.narrow(0, self.rank * self.i, self.i))
        else:
            e.copy_(loaded.narrow(1, self.rank * self.i, self.i))


class Config:
    def __init__(self, vocab=250, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16,
                 inter=128, experts=4, moe_layers=(1,)):
        self.vocab, self.hidden, self.layers = vocab, hidden, layers
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.inter, self.experts, self.moe_layers = inter, experts, set(moe_layers)


class Layer(nn.Module):
    def __init__(self, c: Config, moe: bool, tp, rank, dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden, dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden, dtype)
        self.self_attn = nn.Module()
        self.self_attn.qkv_proj = QKVParallelLinear(c.hidden, c.head_dim, c.heads, c.kv_heads,
                                                    tp, rank, dtype)
        self.self_attn.o_proj = RowParallelLinear(c.heads * c.head_dim, c.hidden, tp, rank, dtype)
        self.mlp = nn.Module()
        if moe:
            self.mlp.gate = nn.Module()
            self.mlp.gate.weight = _param((c.experts, c.hidden), dtype)
            self.mlp.experts = FusedMoE(c.experts, c.hidden, c.inter, tp, rank, dtype)
        else:
            self.mlp.gate_up_proj = MergedColumnParallelLinear(c.hidden, [c.inter, c.inter], tp,
                                                               rank, dtype)
            self.mlp.down_proj = RowParallelLinear(c.inter, c.hidden, tp, rank, dtype)


class Engine(nn.Module):
    """One rank of the model in vLLM's layout."""

    stacked_params_mapping = [
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    ]

    def __init__(self, c: Config, tp: int, rank: int, dtype=torch.bfloat16):
        super().__init__()
        self.c = c
        self.model = nn.Module()
        self.model.embed_tokens = VocabParallelEmbedding(c.vocab, c.hidden, tp, rank, dtype)
        self.model.layers = nn.ModuleList(
            Layer(c, i in c.moe_layers, tp, rank, dtype) for i in range(c.layers))
        self.model.norm = RMSNorm(c.hidden, dtype)
        self.lm_head = ParallelLMHead(c.vocab, c.hidden, tp, rank, dtype)

    def expert_params_mapping(self):
        out = []
        for e in range(self.c.experts):
            for shard, name in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                param = "experts.w13_weight" if shard != "w2" else "experts.w2_weight"
                out.append((param, f"experts.{e}.{name}.", e, shard))
        return out

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]):
        params = dict(self.named_parameters())
        for name, w in weights:
            for param_name, weight_name, shard_id in self.stacked_params_mapping:
                if weight_name not in name or "experts" in name:
                    continue
                p = params[name.replace(weight_name, param_name)]
                p.weight_loader(p, w, shard_id)
                break
            else:
                for param_name, weight_name, expert, shard_id in self.expert_params_mapping():
                    if weight_name not in name:
                        continue
                    pname = name.split("experts.")[0] + param_name
                    p = params[pname]
                    p.weight_loader(p, w, pname, shard_id=shard_id, expert_id=expert)
                    break
                else:
                    p = params[name]
                    getattr(p, "weight_loader", default_weight_loader)(p, w)


def checkpoint_shapes(c: Config):
    """The checkpoint's tensors (Hugging Face names) and shapes."""
    h, hd = c.hidden, c.head_dim
    out = {"model.embed_tokens.weight": (c.vocab, h), "model.norm.weight": (h,),
           "lm_head.weight": (c.vocab, h)}
    for i in range(c.layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "post_attention_layernorm.weight"] = (h,)
        out[p + "self_attn.q_proj.weight"] = (c.heads * hd, h)
        out[p + "self_attn.k_proj.weight"] = (c.kv_heads * hd, h)
        out[p + "self_attn.v_proj.weight"] = (c.kv_heads * hd, h)
        out[p + "self_attn.o_proj.weight"] = (h, c.heads * hd)
        if i in c.moe_layers:
            out[p + "mlp.gate.weight"] = (c.experts, h)
            for e in range(c.experts):
                out[p + f"mlp.experts.{e}.gate_proj.weight"] = (c.inter, h)
                out[p + f"mlp.experts.{e}.up_proj.weight"] = (c.inter, h)
                out[p + f"mlp.experts.{e}.down_proj.weight"] = (h, c.inter)
        else:
            out[p + "mlp.gate_proj.weight"] = (c.inter, h)
            out[p + "mlp.up_proj.weight"] = (c.inter, h)
            out[p + "mlp.down_proj.weight"] = (h, c.inter)
    return out


class Trainer:
    """The checkpoint's tensors as fp32 master weights trained with torch
    AdamW on a toy objective that touches every tensor; ``state()`` is the
    bf16 cast a trainer publishes each step."""

    def __init__(self, c: Config, lr: float = 2e-5, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.params = {n: nn.Parameter(torch.randn(s, generator=g) * 0.05)
                       for n, s in checkpoint_shapes(c).items()}
        self.opt = torch.optim.AdamW(self.params.values(), lr=lr)
        self.g = g

    def step(self):
        loss = 0.0
        for n, p in self.params.items():
            target = torch.randn(p.shape, generator=self.g) * 0.05
            loss = loss + ((p - target) ** 2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()

    def state(self):
        return {n: p.detach().to(torch.bfloat16).contiguous() for n, p in self.params.items()}
