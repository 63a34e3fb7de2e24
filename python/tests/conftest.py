"""Shared fixtures of the package's tests.

torch and transformers are required by the torch tests: they fail when
missing, unless WEIGHTCAST_ALLOW_NO_TORCH=1, which skips them with a
visible SKIPPED line (a machine that cannot install torch)."""

import importlib
import json
import os
import struct

import numpy as np
import pytest


def _require(module: str):
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if os.environ.get("WEIGHTCAST_ALLOW_NO_TORCH") == "1":
            print(f"\nSKIPPED: {module} is not installed (WEIGHTCAST_ALLOW_NO_TORCH=1)")
            pytest.skip(f"{module} is not installed (WEIGHTCAST_ALLOW_NO_TORCH=1)")
        raise AssertionError(
            f"{module} is required by this test ({e}); install it into the test venv "
            "(scripts/test.sh does) or set WEIGHTCAST_ALLOW_NO_TORCH=1 to skip"
        ) from e


@pytest.fixture
def torch():
    return _require("torch")


# Where the engine's tensors live in the tests that take `device`: the CPU
# everywhere; add `cuda` on a machine with a GPU (WEIGHTCAST_TEST_DEVICES=cpu,cuda).
DEVICES = [d for d in os.environ.get("WEIGHTCAST_TEST_DEVICES", "cpu").split(",") if d]


@pytest.fixture(params=DEVICES)
def device(request, torch):
    d = torch.device(request.param)
    if d.type == "cuda":
        assert torch.cuda.is_available(), (
            "WEIGHTCAST_TEST_DEVICES names cuda but torch sees no GPU")
    return d


@pytest.fixture
def transformers():
    _require("torch")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    return _require("transformers")


@pytest.fixture
def bucket(tmp_path):
    """A file:// bucket and a publisher state dir."""
    return f"file://{tmp_path}/bucket", str(tmp_path / "state")


def read_safetensors(path):
    """name -> (dtype, shape, bytes) of a safetensors file (a minimal
    independent reader: the 8-byte header length, the JSON header, the data)."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        a, b = e["data_offsets"]
        out[name] = (e["dtype"], e["shape"], data[a:b])
    return out


def as_bytes(t):
    """A tensor's or array's bytes."""
    if isinstance(t, np.ndarray):
        return np.ascontiguousarray(t).tobytes()
    import torch

    return t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
