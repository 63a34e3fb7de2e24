"""Engine contracts on the Python side (issue #26, item 5): SGLang's
``update_weights_from_tensor`` answers ``(success, message)`` and a refusal
is not served; vLLM's worker extension loads through
``model_runner.get_model()`` and, with ``mode="sparse"``, through vLLM's
checkpoint patch API (``load_checkpoint_weight_patches``, vLLM PR #50723),
stood in for by an independent implementation of its contract."""

import math
import sys
import types
from typing import Any, NamedTuple, Optional, Tuple

import pytest

import weightcast
from weightcast.engine import EngineRefused


class SglangEngine:
    """``sglang.Engine.update_weights_from_tensor``'s contract: loads the
    named tensors and answers ``(success, message)``; a refusal keeps the
    engine's weights (SGLang rolls back). ``answers`` queues the next
    answers (a ``(False, msg)``, or an exception to raise)."""

    def __init__(self, torch):
        self.weights = {}
        self.calls = []
        self.answers = []
        self.torch = torch

    def update_weights_from_tensor(self, named_tensors, flush_cache=True):
        named_tensors = list(named_tensors)
        self.calls.append(([n for n, _ in named_tensors], flush_cache))
        if self.answers:
            a = self.answers.pop(0)
            if isinstance(a, Exception):
                raise a
            return a
        for n, t in named_tensors:
            self.weights[n] = t.clone()
        return True, "Succeeded to update model weights."


def test_sglang_refused_update_is_not_served_and_handed_again(torch, bucket):
    url, state = bucket
    engine = SglangEngine(torch)
    pub = weightcast.Publisher(url, state_dir=state)
    w = {"a": torch.randn(10_000), "b": torch.randn(500).bfloat16()}
    pub.publish(w, step=1)
    f = weightcast.sglang.follow(engine, url)
    assert f.step()["version"] == 0 and f.version == 0
    assert engine.calls[-1] == (["a", "b"], True)

    # SGLang refuses version 1: not served, raised, owed.
    w["a"][7] = 3.0
    w["b"][1] = 2.0
    pub.publish(w, step=2)
    engine.answers = [(False, "Failed to update weights: out of memory")]
    with pytest.raises(EngineRefused, match="out of memory"):
        f.step()
    assert f.version == 0, "a refused version is not served"
    assert f.owed == (1, ["a", "b"])
    assert not torch.equal(engine.weights["a"], w["a"])
    # Still refusing (an exception this time): still owed, nothing new polled.
    engine.answers = [RuntimeError("scheduler busy")]
    with pytest.raises(EngineRefused, match="scheduler busy"):
        f.step()
    assert f.version == 0 and f.owed == (1, ["a", "b"])
    # Taken: served, the same tensors handed again from the host copy.
    report = f.step()
    assert report["kind"] == "retry" and report["version"] == 1
    assert f.version == 1 and f.owed is None
    assert torch.equal(engine.weights["a"], w["a"]) and torch.equal(engine.weights["b"], w["b"])
    # And the next delta applies on top.
    w["a"][9] = -1.0
    pub.publish(w, step=3)
    assert f.step()["version"] == 2 and engine.calls[-1] == (["a"], True)
    assert torch.equal(engine.weights["a"], w["a"])


@pytest.mark.parametrize("answer", [False, {"success": False, "message": "no"}])
def test_loader_refusals_in_other_shapes(torch, bucket, answer):
    url, state = bucket
    pub = weightcast.Publisher(url, state_dir=state)
    pub.publish({"a": torch.zeros(8)}, step=1)
    f = weightcast.engine.Follower(url, loader=lambda ws: answer)
    with pytest.raises(EngineRefused):
        f.step()
    assert f.version is None


class CheckpointWeightPatch(NamedTuple):
    name: str
    shape: Tuple[int, ...]
    dtype: Any
    values: Any
    indices: Optional[Any] = None


def patch_api(torch, calls):
    """An independent implementation of the contract of vLLM's
    ``load_checkpoint_weight_patches(model, patches)``: dense and sparse
    patches are not mixed in one call; a sparse patch (float dtype, no NaN
    among its values) becomes a checkpoint-shaped tensor of NaN with the
    values at its flat indices, and goes through ``model.load_weights``
    while every final ``Tensor.copy_`` keeps the destination where the
    source is NaN."""

    def load_checkpoint_weight_patches(model, patches):
        patches = list(patches)
        kinds = {p.indices is None for p in patches}
        assert len(kinds) <= 1, "dense and sparse patches cannot be mixed"
        calls.append(patches)
        weights = []
        for p in patches:
            n = math.prod(p.shape)
            if p.indices is None:
                weights.append((p.name, p.values.to(p.dtype).view(p.shape)))
                continue
            assert p.dtype.is_floating_point and not bool(torch.isnan(p.values).any())
            assert p.indices.dtype in (torch.int32, torch.int64)
            full = torch.full((n,), float("nan"), dtype=p.dtype)
            full.index_copy_(0, p.indices.long(), p.values.to(p.dtype))
            weights.append((p.name, full.view(p.shape)))
        if kinds != {False}:
            return model.load_weights(weights)
        plain = torch.Tensor.copy_

        def copy_keeping_nan(dst, src, non_blocking=False):
            assert dst.shape == src.shape and dst.is_floating_point()
            src = src.to(dst.dtype)
            return plain(dst, torch.where(torch.isnan(src), dst, src))

        torch.Tensor.copy_ = copy_keeping_nan
        try:
            return model.load_weights(weights)
        finally:
            torch.Tensor.copy_ = plain

    return load_checkpoint_weight_patches


def install_fake_vllm(monkeypatch, torch, calls):
    names = ["vllm", "vllm.model_executor", "vllm.model_executor.model_loader",
             "vllm.model_executor.model_loader.checkpoint_weight_patch"]
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    mod = sys.modules[names[-1]]
    mod.CheckpointWeightPatch = CheckpointWeightPatch
    mod.load_checkpoint_weight_patches = patch_api(torch, calls)


class Model:
    """A model with vLLM's ``load_weights`` (each tensor copied into the
    parameter of its name, one same-shaped ``copy_``)."""

    def __init__(self, torch, tensors):
        self.tensors = {k: torch.zeros_like(v) for k, v in tensors.items()}
        self.loaded = []

    def parameters(self):
        return iter(self.tensors.values())

    def load_weights(self, weights):
        names = []
        for name, t in weights:
            self.tensors[name].copy_(t)
            names.append(name)
        self.loaded.append(names)
        return set(names)


def test_vllm_sparse_mode_hands_changed_elements(torch, bucket, monkeypatch):
    from test_torch import FakeWorker

    url, state = bucket
    calls = []
    install_fake_vllm(monkeypatch, torch, calls)
    torch.manual_seed(0)
    w = {"f32": torch.randn(64, 32), "bf16": torch.randn(4096).bfloat16(),
         "steps": torch.arange(16, dtype=torch.int64)}
    pub = weightcast.Publisher(url, state_dir=state)
    pub.publish(w, step=1)
    model = Model(torch, w)
    worker = FakeWorker(model)
    worker.weightcast_init(url, mode="sparse")
    assert worker.weightcast_update()["kind"] == "anchor"
    assert calls == [] and sorted(model.loaded[-1]) == ["bf16", "f32", "steps"]
    for k in w:
        assert torch.equal(model.tensors[k], w[k])

    w["f32"][3, 5] = 7.0
    w["f32"][60, 1] = -2.5
    w["bf16"][[1, 100, 4000]] = torch.tensor([0.5, -1.0, 3.0]).bfloat16()
    w["steps"][2] = 99
    pub.publish(w, step=2)
    report = worker.weightcast_update()
    assert report["kind"] == "delta" and worker.weightcast_version() == 1
    # The float tensors went as sparse patches of their changed elements;
    # the integer one whole through load_weights.
    (patches,) = calls
    by_name = {p.name: p for p in patches}
    assert set(by_name) == {"f32", "bf16"}
    assert sorted(by_name["f32"].indices.tolist()) == [3 * 32 + 5, 60 * 32 + 1]
    assert sorted(by_name["bf16"].indices.tolist()) == [1, 100, 4000]
    assert by_name["bf16"].dtype == torch.bfloat16 and by_name["f32"].shape == (64, 32)
    assert model.loaded[-1] == ["steps"]
    for k in w:
        assert torch.equal(model.tensors[k], w[k]), k


def test_vllm_sparse_mode_needs_the_patch_api(torch, bucket, monkeypatch):
    from test_torch import FakeWorker

    url, _ = bucket
    monkeypatch.setitem(sys.modules, "vllm", None)  # not importable
    worker = FakeWorker(Model(torch, {"a": torch.zeros(2)}))
    with pytest.raises(weightcast.ConfigError, match="load_checkpoint_weight_patches"):
        worker.weightcast_init(url, mode="sparse")
    with pytest.raises(weightcast.BadRequest, match="expected one of"):
        worker.weightcast_init(url, mode="dense")
