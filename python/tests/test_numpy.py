"""The package with numpy alone: publish from memory, follow, apply in place."""

import os

import numpy as np
import pytest

import weightcast
from conftest import as_bytes, read_safetensors


def model(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "embed": rng.standard_normal((256, 64)).astype(np.float32),
        "layer.w": rng.standard_normal((64, 64)).astype(np.float16),
        "layer.b": rng.standard_normal(64).astype(np.float64),
        "counts": rng.integers(0, 1 << 40, 100, dtype=np.int64),
        # bf16 without ml_dtypes: the raw words
        "bf16": weightcast.Raw(rng.integers(0, 1 << 16, 300, dtype=np.uint16), "BF16", (3, 100)),
    }


def train_step(w, rng, frac=0.02):
    for name, t in w.items():
        arr = t.data if isinstance(t, weightcast.Raw) else t
        flat = arr.reshape(-1)
        idx = rng.choice(flat.size, max(1, int(flat.size * frac)), replace=False)
        if arr.dtype.kind == "f":
            flat[idx] += arr.dtype.type(0.5)
        else:
            flat[idx] += 1


def zeros_like(w):
    return {
        k: weightcast.Raw(np.zeros_like(v.data), v.dtype, v.shape)
        if isinstance(v, weightcast.Raw) else np.zeros_like(v)
        for k, v in w.items()
    }


def same(a, b):
    return all(as_bytes(_arr(a[k])) == as_bytes(_arr(b[k])) for k in a) and a.keys() == b.keys()


def _arr(t):
    return t.data if isinstance(t, weightcast.Raw) else t


def test_every_version_applied_in_place_is_bit_identical(bucket):
    url, state = bucket
    pub = weightcast.Publisher(url, state_dir=state, anchor_every=4)
    sub = weightcast.Subscriber(url)
    assert sub.poll() is None, "an empty bucket has no update"
    w, mine, rng = model(), None, np.random.default_rng(1)
    kinds = []
    for step in range(1, 9):
        if step > 1:
            train_step(w, rng)
        out = pub.publish(w, step=step)
        assert out["version"] == step - 1
        u = sub.poll()
        assert u is not None and u.version == out["version"]
        if mine is None:
            assert u.kind == "anchor" and u.base_version is None
            mine = zeros_like(w)
        else:
            assert u.kind == "delta" and u.base_version == out["version"] - 1
        kinds.append(u.kind)
        report = u.apply_to(mine)
        assert report["version"] == out["version"]
        assert same(mine, w), f"version {out['version']} differs after apply"
        assert sub.version == out["version"]
        assert sub.poll() is None
    # anchors every 4 versions are published, but a follower replays deltas
    assert kinds == ["anchor"] + ["delta"] * 7
    assert sub.verify(mine)["checked"] == len(w)


def following(bucket, seed, via="auto"):
    """A publisher, a subscriber, the trainer's tensors and the engine's,
    after version 0 was applied."""
    url, state = bucket
    pub = weightcast.Publisher(url, state_dir=state)
    sub = weightcast.Subscriber(url)
    w, rng = model(), np.random.default_rng(seed)
    pub.publish(w, step=1)
    mine = zeros_like(w)
    assert sub.poll().apply_to(mine, via=via)["via"] == ("buffers" if via == "auto" else via)
    assert same(mine, w)
    return pub, sub, w, rng, mine


def test_modified_base_is_refused_untouched_then_repaired_by_an_anchor(bucket):
    pub, sub, w, rng, mine = following(bucket, 2)
    train_step(w, rng)
    pub.publish(w, step=2)
    u = sub.poll()
    # corrupt an element the delta changes: the first position that differs
    changed = np.flatnonzero(as_np(mine["embed"]) != as_np(w["embed"]))
    assert changed.size
    mine["embed"].reshape(-1)[changed[0]] = 123.0
    before = {k: as_bytes(_arr(v)) for k, v in mine.items()}
    with pytest.raises(weightcast.BaseMismatch) as e:
        u.apply_to(mine)
    assert isinstance(e.value, weightcast.Corrupt) and isinstance(e.value, weightcast.Error)
    assert "embed" in str(e.value)
    assert {k: as_bytes(_arr(v)) for k, v in mine.items()} == before, "nothing written"
    assert sub.version == 0
    # the next poll repairs with an anchor of the newest version
    a = sub.poll()
    assert a.kind == "anchor" and a.version == 1
    a.apply_to(mine)
    assert same(mine, w) and sub.version == 1


@pytest.mark.parametrize("via", ["buffers", "scatter"])
def test_prepare_then_commit_is_bit_identical_and_prepare_writes_nothing(bucket, via):
    """The engine's side of a pause: prepare while serving (verify, decode or
    stage; nothing written), then commit (the writes only)."""
    pub, sub, w, rng, mine = following(bucket, 4, via=via)
    for step in range(2, 6):
        train_step(w, rng)
        out = pub.publish(w, step=step)
        u = sub.poll()
        before = {k: as_bytes(_arr(v)) for k, v in mine.items()}
        assert u.prepare(mine, via=via) is True
        assert {k: as_bytes(_arr(v)) for k, v in mine.items()} == before, "prepare wrote"
        assert sub.version == out["version"] - 1, "prepare does not advance the version"
        report = u.commit()
        assert report["version"] == out["version"] and report["via"] == via
        assert report.get("prepared", via == "scatter"), report
        assert same(mine, w) and sub.version == out["version"]
        with pytest.raises(weightcast.BadRequest, match="prepare"):
            u.commit()
    # A modified base is refused by prepare, nothing is modified, and the
    # next poll repairs with an anchor, which prepare leaves whole to commit.
    train_step(w, rng)
    pub.publish(w, step=6)
    u = sub.poll()
    changed = np.flatnonzero(as_np(mine["embed"]) != as_np(w["embed"]))
    mine["embed"].reshape(-1)[changed[0]] = 123.0
    before = {k: as_bytes(_arr(v)) for k, v in mine.items()}
    with pytest.raises(weightcast.BaseMismatch, match="embed"):
        u.prepare(mine, via=via)
    assert {k: as_bytes(_arr(v)) for k, v in mine.items()} == before
    a = sub.poll()
    assert a.kind == "anchor" and a.prepare(mine, via=via) is False
    a.commit()
    assert same(mine, w) and sub.version == a.version


def test_the_device_calls_refuse_misuse_and_write_nothing(bucket):
    """The batched device path's native calls: in order, on buffers that fit
    and do not overlap, for the update staged; a refused call writes none of
    the tensors and the update still applies."""
    pub, sub, w, rng, mine = following(bucket, 4, via="scatter")
    train_step(w, rng)
    pub.publish(w, step=2)
    u = sub.poll()
    n = u._native
    before = {k: as_bytes(_arr(v)) for k, v in mine.items()}
    with pytest.raises(weightcast.BadRequest, match="device_changes first"):
        n.device_positions(0, 0)
    plan, pos_bytes, word_bytes = n.device_changes()
    assert plan and all(off % 8 == 0 for p in plan for off in p[4:])
    assert sum(p[1] for p in plan) > 0 and word_bytes >= sum(p[1] * p[3] for p in plan)
    small = np.empty(max(0, pos_bytes - 8), dtype=np.uint8)
    with pytest.raises(weightcast.BadRequest, match="positions buffer"):
        n.device_positions(small.__array_interface__["data"][0], small.nbytes)
    buf = np.zeros(2 * word_bytes, dtype=np.uint8)
    at = buf.__array_interface__["data"][0]
    with pytest.raises(weightcast.BadRequest, match="overlap"):
        n.device_resolve((at, word_bytes), (at + 8, word_bytes))
    with pytest.raises(weightcast.BadRequest, match="word buffers"):
        n.device_resolve((at, word_bytes - 8), (at + word_bytes, word_bytes))
    # Old words of zeros are not the base: refused, and the commit that
    # would record the version refuses too (nothing was resolved).
    with pytest.raises(weightcast.BaseMismatch):
        n.device_resolve((at, word_bytes), (at + word_bytes, word_bytes))
    with pytest.raises(weightcast.BadRequest, match="device_changes first"):  # used up
        n.device_resolve((at, word_bytes), (at + word_bytes, word_bytes))
    with pytest.raises(weightcast.BadRequest, match="not resolved"):
        n.commit_resolved()
    assert {k: as_bytes(_arr(v)) for k, v in mine.items()} == before
    assert sub.version == 0
    # The version still arrives (applied whole, or as the repair's anchor).
    v = sub.poll() or u
    v.apply_to(mine, via="scatter")
    assert same(mine, w) and sub.version == 1


def test_commit_needs_the_prepared_tensors(bucket):
    pub, sub, w, rng, mine = following(bucket, 5)
    train_step(w, rng)
    pub.publish(w, step=2)
    u = sub.poll()
    assert u.prepare(mine)
    # Another copy of the same values is other memory: refused, unwritten.
    saved = u._prepared
    u._prepared = ({k: (v.copy() if isinstance(v, np.ndarray) else
                        weightcast.Raw(v.data.copy(), v.dtype, v.shape))
                    for k, v in mine.items()},) + saved[1:]
    with pytest.raises(weightcast.BadRequest, match="prepared on"):
        u.commit()
    assert sub.version == 0
    # The refused commit kept the prepared changes: given the tensors it was
    # prepared on, it goes through.
    u._prepared = saved
    u.commit()
    assert same(mine, w) and sub.version == 1


def as_np(x):
    return np.asarray(x)


def test_corruption_outside_the_changes_is_found_by_verify(bucket):
    _, sub, _, _, mine = following(bucket, 0)
    mine["layer.b"][3] += 1.0
    with pytest.raises(weightcast.Corrupt, match="layer.b"):
        sub.verify(mine)


def test_scatter_path_matches_and_refuses_like_the_buffer_path(bucket):
    pub, sub, w, rng, mine = following(bucket, 3, via="scatter")
    for step in (2, 3):
        train_step(w, rng)
        pub.publish(w, step=step)
        sub.poll().apply_to(mine, via="scatter")
        assert same(mine, w)
    train_step(w, rng)
    pub.publish(w, step=4)
    u = sub.poll()
    idx = np.flatnonzero(mine["layer.w"].reshape(-1) != w["layer.w"].reshape(-1))[0]
    mine["layer.w"].reshape(-1)[idx] = 0
    before = {k: as_bytes(_arr(v)) for k, v in mine.items()}
    with pytest.raises(weightcast.BaseMismatch):
        u.apply_to(mine, via="scatter")
    assert {k: as_bytes(_arr(v)) for k, v in mine.items()} == before


def test_late_joiner_and_whole_tensor_engines(bucket, tmp_path):
    url, state = bucket
    pub = weightcast.Publisher(url, state_dir=state, anchor_every=3)
    w, rng = model(), np.random.default_rng(4)
    for step in range(1, 6):
        if step > 1:
            train_step(w, rng)
        pub.publish(w, files={"config.json": b'{"step": %d}' % step}, step=step)
    late = weightcast.Subscriber(url)
    u = late.poll()
    assert u.kind == "anchor" and u.version == 4
    whole = dict(u.changed_tensors())
    assert set(whole) == set(w)
    for k in w:
        assert as_bytes(_arr(whole[k])) == as_bytes(_arr(w[k]))
    assert u.files()["config.json"] == b'{"step": 5}'
    # save_to materializes like `weightcast subscribe --out`
    u.save_to(tmp_path / "out")
    files = read_safetensors(tmp_path / "out" / "current" / "model.safetensors")
    for k in w:
        assert files[k][2] == as_bytes(_arr(w[k])), k
    assert (tmp_path / "out" / "current" / "config.json").read_bytes() == b'{"step": 5}'
    # a whole-tensor engine: changed_tensors(host) patches the host copy and
    # yields only the changed tensors
    host = zeros_like(w)
    u.apply_to(host)
    train_step(w, rng, frac=0.001)
    w["counts"][:] = np.arange(100)  # a tensor that changes entirely
    pub.publish(w, step=6)
    d = late.poll()
    got = dict(d.changed_tensors(host))
    assert "counts" in got and set(got) <= set(w)
    assert same(host, w)


def test_errors_are_typed_and_name_the_problem(bucket):
    url, state = bucket
    with pytest.raises(weightcast.ConfigError, match="encoding"):
        weightcast.Publisher(url, state_dir=state, encoding="zip")
    with pytest.raises(weightcast.BadRequest):
        weightcast.Publisher(url, state_dir=state).publish({"x": [1, 2, 3]})
    pub = weightcast.Publisher(url, state_dir=state)
    w = model()
    pub.publish(w, step=5)
    with pytest.raises(weightcast.Error, match="step"):
        pub.publish(w, step=5)  # steps must increase
    sub = weightcast.Subscriber(url)
    u = sub.poll()
    wrong = zeros_like(w)
    wrong["embed"] = np.zeros((64, 256), np.float32)
    with pytest.raises(weightcast.BaseMismatch, match="embed"):
        u.apply_to(wrong)
    missing = zeros_like(w)
    del missing["counts"]
    with pytest.raises(weightcast.BadRequest, match="counts"):
        u.apply_to(missing)
    shared = zeros_like(w)
    shared["layer.b"] = shared["counts"].view(np.float64)[:64]
    with pytest.raises(weightcast.BadRequest, match="share memory"):
        u.apply_to(shared)
    readonly = zeros_like(w)
    readonly["embed"].setflags(write=False)
    with pytest.raises(weightcast.BadRequest, match="read-only"):
        u.apply_to(readonly)
    assert sub.version is None, "no failed apply advances the subscriber"


def test_wait_times_out_and_wakes_on_a_new_version(bucket):
    import threading

    url, state = bucket
    pub = weightcast.Publisher(url, state_dir=state)
    sub = weightcast.Subscriber(url, poll_interval=0.05)
    assert sub.wait(timeout=0.2) is None
    w = model()
    t = threading.Timer(0.3, lambda: pub.publish(w, step=1))
    t.start()
    u = sub.wait(timeout=20)
    t.join()
    assert u is not None and u.version == 0


def test_a_listening_subscriber_is_pushed_each_version(bucket, caplog):
    """Push, as `weightcast subscribe --listen --id` does it: the subscriber
    registers its endpoint in the bucket, the publisher notifies it, and
    wait() returns at once although the poll interval is far longer than the
    wait's timeout (without the notification every wait below would time
    out)."""
    import json as _json
    import logging
    import threading
    import urllib.request

    url, state = bucket
    key = "a-test-secret-of-32-characters-x"
    pub = weightcast.Publisher(url, state_dir=state, notify_key=key)
    sub = weightcast.Subscriber(url, poll_interval=600, listen="127.0.0.1:0",
                                notify_key=key, id="py-engine-1")
    assert sub.notify_url.startswith("http://127.0.0.1:") and sub.notify_url.endswith("/v1/notify")
    assert sub.poll() is None, "an empty bucket has no update; this poll registers"
    registered = os.path.join(url[len("file://"):], "subscribers", "py-engine-1.json")
    assert _json.load(open(registered))["notify_url"] == sub.notify_url
    w, mine, rng = model(), zeros_like(model()), np.random.default_rng(3)
    for step in range(1, 4):
        if step > 1:
            train_step(w, rng)
        done = {}

        def trainer():
            done["out"] = pub.publish(w, step=step)
            done["acks"] = pub.notifications_settled()

        # The publish starts after wait() has polled once and found nothing,
        # so only the notification can end the wait before its timeout.
        t = threading.Timer(0.5, trainer)
        t.start()
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="weightcast"):
            u = sub.wait(timeout=30)
        t.join()
        # A wait that timed out would still find the version in its last
        # poll; the log says whether the notification ended it.
        assert any(r.getMessage().startswith("notified") for r in caplog.records), \
            "wait() was not woken by the notification"
        out = done["out"]
        assert "notified" not in out, "publish returns before the fan-out"
        assert done["acks"] == 1
        assert u is not None, "wait() timed out: the notification did not wake it"
        assert u.version == out["version"], (u, out)
        u.apply_to(mine)
        assert same(mine, w)
    assert sub.notifications == 3
    # The endpoint is the library's: its status reports the held version.
    status = _json.load(urllib.request.urlopen(sub.notify_url.replace("/v1/notify", "/v1/status")))
    assert status["version"] == 2 and status["lag"] == 0, status
    # The registration follows the version the tensors hold.
    sub.poll()
    assert _json.load(open(registered))["version"] == 2
    with pytest.raises(weightcast.ConfigError, match="notify_key"):
        weightcast.Subscriber(url, listen="127.0.0.1:0")
    with pytest.raises(weightcast.ConfigError, match="listen"):
        weightcast.Subscriber(url, id="x")
    with pytest.raises(weightcast.ConfigError, match="advertise"):
        weightcast.Subscriber(url, listen="0.0.0.0:0", notify_key=key, id="x")


def test_hooks_python_callables_and_library_kinds(tmp_path):
    seen = []
    marker = tmp_path / "hook-ran"
    report = weightcast.run_hooks(
        [seen.append, f"command:touch {marker}", lambda e: 1 / 0],
        version=3, dir=tmp_path, changed_tensors=["a"],
    )
    assert seen == [{"version": 3, "dir": os.fspath(tmp_path), "changed_tensors": ["a"]}]
    assert marker.exists()
    assert report["failed"] == 1 and "ZeroDivisionError" in report["failures"][0]["message"]
    with pytest.raises(weightcast.Error):
        weightcast.run_hooks(["nonsense"], version=1, dir=tmp_path)


def test_tensor_digest_matches_the_published_header(bucket):
    url, state = bucket
    pub = weightcast.Publisher(url, state_dir=state)
    w = model()
    pub.publish(w, step=1)
    d1 = weightcast.tensor_digest("embed", w["embed"])
    w["embed"][0, 0] += 1
    assert weightcast.tensor_digest("embed", w["embed"]) != d1


def test_single_pass_apply_is_bit_identical_and_puts_back_on_refusal(bucket):
    pub, sub, w, rng, mine = following(bucket, 5)
    for step in (2, 3):
        train_step(w, rng)
        pub.publish(w, step=step)
        report = sub.poll().apply_to(mine, single_pass=True)
        assert report.get("single_pass") is True
        assert same(mine, w)
    train_step(w, rng)
    pub.publish(w, step=4)
    u = sub.poll()
    idx = np.flatnonzero(mine["embed"].reshape(-1) != w["embed"].reshape(-1))[-1]
    mine["embed"].reshape(-1)[idx] += 7.0
    before = {k: as_bytes(_arr(v)) for k, v in mine.items()}
    with pytest.raises(weightcast.BaseMismatch, match="embed"):
        u.apply_to(mine, single_pass=True)
    assert {k: as_bytes(_arr(v)) for k, v in mine.items()} == before, "every write put back"
    assert sub.version == 2
    assert sub.poll().kind == "anchor"


def test_two_ranks_publish_one_version_per_step(tmp_path):
    """Two trainer ranks (threads, each with its own state) publish their
    own shard files of each step; one version per step holds both shards."""
    import threading

    url = f"file://{tmp_path}/bucket"
    full = model(3)
    names = sorted(full)
    shards = [{k: full[k] for k in names[:2]}, {k: full[k] for k in names[2:]}]
    pubs = [
        weightcast.Publisher(url, state_dir=str(tmp_path / f"state-{r}"), rank=r, world=2,
                             rank_timeout=60)
        for r in range(2)
    ]
    sub = weightcast.Subscriber(url)
    mine, rng = None, np.random.default_rng(4)
    for step in range(1, 5):
        if step > 1:
            train_step(full, rng)
        outs, errors = [None, None], []

        def run(r):
            try:
                outs[r] = pubs[r].publish(shards[r], step=step,
                                          file_name=f"model-0000{r + 1}-of-00002.safetensors")
            except Exception as e:  # surfaced below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert outs[0]["version"] == outs[1]["version"] == step - 1, outs
        assert outs[0]["kind"] == outs[1]["kind"]
        u = sub.poll()
        assert u is not None and u.version == step - 1
        if mine is None:
            mine = zeros_like(full)
        u.apply_to(mine)
        assert same(mine, full), f"step {step}"
    with pytest.raises(weightcast.Error, match="rank"):
        weightcast.Publisher(url, state_dir=str(tmp_path / "s"), rank=2, world=2)


def test_an_update_is_bound_to_the_tensors_its_subscriber_manages(bucket):
    """Issue #30, case 5: one subscriber's update applied to another
    subscriber's tensors was accepted (the base values it checks agreed) and
    advanced the wrong subscriber. It is refused, nothing written, nothing
    advanced, and the update still applies to its own subscriber's tensors."""
    url, state = bucket
    pub = weightcast.Publisher(url, state_dir=state)
    w, rng = model(), np.random.default_rng(11)
    pub.publish(w, step=1)
    a, b = weightcast.Subscriber(url), weightcast.Subscriber(url)
    mine_a, mine_b = zeros_like(w), zeros_like(w)
    a.poll().apply_to(mine_a)
    b.poll().apply_to(mine_b)
    train_step(w, rng)
    pub.publish(w, step=2)
    ua = a.poll()
    before = {k: as_bytes(_arr(v)) for k, v in mine_b.items()}
    with pytest.raises(weightcast.BadRequest, match="not the memory this subscriber"):
        ua.apply_to(mine_b)
    assert {k: as_bytes(_arr(v)) for k, v in mine_b.items()} == before, "nothing written"
    assert a.version == 0 and b.version == 0
    # Also through prepare: refused before anything is decoded.
    with pytest.raises(weightcast.BadRequest, match="not the memory this subscriber"):
        ua.prepare(mine_b)
    ua.apply_to(mine_a)
    assert same(mine_a, w) and a.version == 1 and b.version == 0
    b.poll().apply_to(mine_b)
    assert same(mine_b, w) and b.version == 1
