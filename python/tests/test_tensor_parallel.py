"""A tensor-parallel engine follows a bucket in place (issue #26): 2 and 4
worker processes (``torch.distributed`` with gloo) hold a Llama-like model
with an MoE layer in vLLM's layout (fused ``qkv_proj`` and ``gate_up_proj``,
column and row shards, KV heads replicated across ranks, padded vocabulary
shards, stacked experts; ``vllm_standin.py``). They follow published
versions of real AdamW steps through :class:`weightcast.node.TensorParallelFollower`:

- at every version each rank's parameters are bit-identical to a fresh
  load of that version through the engine's own loader, sharded the same
  way;
- only the node's rank reads the bucket, each version once;
- a rank made to fail in prepare leaves every rank on the previous
  version, reported; the hand-off removed under the followers, or one byte
  of it changed in a stripe only another rank than the node's checks, is
  detected and rebuilt; the version then goes through.
"""

import json
import os
import socket
import sys

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, os.path.dirname(__file__))

VERSIONS = 6  # an anchor and five deltas



def _close(dist):
    """Ends a worker once every rank is past its last collective, without
    tearing the group down: the process exits at once (``os._exit``), its
    sockets closed by the kernel. A rank that tears its connections down
    while the other still finishes a collective makes gloo's transport
    thread abort that rank, and so, seen again under load after the barrier
    was added, did ``destroy_process_group`` or the interpreter's teardown
    (``terminate called without an active exception``): a C++ thread
    destroyed while joinable. Every check of the worker has run by then."""
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

def _assert_like_a_fresh_load(params, out, v, world, rank):
    """This rank's parameters equal, bit for bit, a fresh engine's loaded
    through its own loader from the trainer's state of version ``v``."""
    from vllm_standin import Config, Engine

    truth = torch.load(os.path.join(out, f"truth-{v}.pt"))
    fresh = Engine(Config(), world, rank)
    fresh.load_weights(iter(truth.items()))
    for name, p in fresh.named_parameters():
        got = params[name].data.view(-1).view(torch.int16)
        assert torch.equal(got, p.data.view(-1).view(torch.int16)), f"{name} at version {v}"


def _worker(rank, world, url, state, root, init, out):
    import torch.distributed as dist

    import weightcast
    import weightcast.node
    from vllm_standin import Config, Engine, Trainer
    from weightcast.node import TensorParallelFollower

    # Small stripes, so that the test's patches have several and each rank
    # checks its own.
    weightcast.node.STRIPE = 4096
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    c = Config()
    engine = Engine(c, world, rank)
    params = dict(engine.named_parameters())
    injected = set()
    stripes = []

    def fail(h):
        # Rank 1 fails version 3 once; at version 4 the hand-off is removed
        # under every rank (the node's shared memory cleaned up).
        if rank == 1 and h.version == 3 and "fail" not in injected:
            injected.add("fail")
            raise RuntimeError("injected failure in prepare")
        if rank == 1 and h.version == 4 and h.op == "patch" and "gone" not in injected:
            injected.add("gone")
            import shutil

            shutil.rmtree(h.patch)
        if rank == 1 and h.version == 5 and h.op == "patch" and "flipped" not in injected:
            # One byte of stripe 1, which rank 1 checks (1 ≡ 1 mod world).
            injected.add("flipped")
            meta = json.load(open(os.path.join(h.patch, "patch.json")))
            stripes.append(len(meta["stripes"]))
            with open(os.path.join(h.patch, "patch.bin"), "r+b") as f:
                f.seek(meta["stripe"] + 17)
                b = f.read(1)
                f.seek(meta["stripe"] + 17)
                f.write(bytes([b[0] ^ 0x40]))

    follower = TensorParallelFollower(url if rank == 0 else None, params, engine.load_weights,
                                      root=root, fail_prepare=fail)
    trainer = Trainer(c) if rank == 0 else None
    pub = weightcast.Publisher(url, state_dir=state, anchor_every=100) if rank == 0 else None
    events = []
    for v in range(VERSIONS):
        if rank == 0:
            if v:
                trainer.step()
            truth = trainer.state()
            assert pub.publish(truth, step=v)["version"] == v
            torch.save(truth, os.path.join(out, f"truth-{v}.pt"))
        dist.barrier()
        for _ in range(4):
            r = follower.step()
            events.append([r.op, r.version, r.committed, r.versions, r.failures])
            assert r.consistent(), r
            if r.committed and r.version == v:
                break
        else:
            raise AssertionError(f"rank {rank}: version {v} never committed: {events}")
        _assert_like_a_fresh_load(params, out, v, world, rank)
    report = {"events": events, "stripes": stripes}
    if rank == 0:
        report["downloaded"] = follower.node.downloaded
    else:
        assert follower.node is None, "only the node's rank reads the bucket"
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump(report, f)
    _close(dist)


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_follow_in_place_bit_identically_and_commit_together(bucket, tmp_path, world):
    import torch.multiprocessing as mp

    url, state = bucket
    root = f"/dev/shm/weightcast-test-{os.getpid()}-{world}"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init = f"tcp://127.0.0.1:{port}"
    try:
        mp.spawn(_worker, args=(world, url, state, root, init, str(tmp_path)), nprocs=world,
                 join=True)
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    reports = [json.load(open(tmp_path / f"rank-{r}.json")) for r in range(world)]
    events = reports[0]["events"]
    # Every rank saw the same steps.
    assert all(r["events"] == events for r in reports), reports
    # The injected failure: nobody committed version 3 at first, the
    # failing rank is named, every rank stayed at 2; then 3 went through.
    fail = [e for e in events if e[1] == 3 and not e[2]]
    assert fail and fail[0][3] == [2] * world, events
    assert "injected failure" in fail[0][4][1] and all(
        f is None for i, f in enumerate(fail[0][4]) if i != 1), events
    # The hand-off removed under the followers: refused, the ranks repaired
    # from the node's host copy, version 4 then committed.
    gone = [e for e in events if e[1] == 4 and not e[2]]
    assert gone and "Corrupt" in gone[0][4][1], events
    assert any(e[0] == "load" and e[1] == 3 and e[2] for e in events), events
    # One byte changed in a stripe rank 1 checks: refused by rank 1, so by
    # every rank; rebuilt and repaired; version 5 then committed.
    assert reports[1]["stripes"] and reports[1]["stripes"][0] >= 2, reports[1]
    flipped = [e for e in events if e[1] == 5 and not e[2]]
    assert flipped and "Corrupt" in flipped[0][4][1], events
    assert flipped[0][3] == [4] * world, events
    assert any(e[0] == "load" and e[1] == 4 and e[2] for e in events), events
    # One download per version for the node: the failures retried the same
    # downloaded update.
    downloaded = reports[0]["downloaded"]
    assert sorted(int(v) for v in downloaded) == list(range(VERSIONS)), downloaded
    assert all(n == 1 for n, _ in downloaded.values()), downloaded
    committed = [e[1] for e in events if e[2] and e[0] == "patch"]
    assert committed == list(range(1, VERSIONS)), events


def _unmappable_worker(rank, world, url, state, root, init, out):
    import torch.distributed as dist

    import weightcast
    from vllm_standin import Config, Engine, Trainer
    from weightcast.node import TensorParallelFollower

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    c = Config()
    engine = Engine(c, world, rank)
    # An engine that keeps one layer's norm in another dtype's kernel format:
    # the probe refuses it by name, on every rank, and nothing is written.
    p = engine.model.layers[0].input_layernorm.weight
    p.data = torch.zeros(p.shape, dtype=torch.float8_e4m3fn)
    params = dict(engine.named_parameters())
    before = {n: t.data.clone() for n, t in params.items()}
    f = TensorParallelFollower(url if rank == 0 else None, params, engine.load_weights, root=root)
    if rank == 0:
        weightcast.Publisher(url, state_dir=state).publish(Trainer(c).state(), step=0)
    dist.barrier()
    r = f.step()
    assert not r.committed and r.versions == [None] * world, r
    assert all("float8_e4m3fn" in (e or "") for e in r.failures), r.failures
    for n, t in params.items():
        assert t.data.dtype != before[n].dtype or torch.equal(t.data, before[n]), n
    _close(dist)


def _spawn(worker, world, bucket, root, out=""):
    """Runs ``worker(rank, world, url, state, root, init, out)`` on
    ``world`` processes of one gloo group; removes ``root`` after."""
    import shutil

    import torch.multiprocessing as mp

    url, state = bucket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.spawn(worker, args=(world, url, state, root, f"tcp://127.0.0.1:{port}", out),
                 nprocs=world, join=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_an_unmappable_layout_is_refused_by_name_on_every_rank(bucket):
    _spawn(_unmappable_worker, 2, bucket, f"/dev/shm/weightcast-test-{os.getpid()}-unmappable")


def _publish(rank, trainer, pub, v, out):
    """Rank 0 publishes version ``v`` (a training step after the first) and
    keeps its truth for the ranks to compare with."""
    if rank == 0:
        if v:
            trainer.step()
        truth = trainer.state()
        assert pub.publish(truth, step=v)["version"] == v
        torch.save(truth, os.path.join(out, f"truth-{v}.pt"))


def _vllm_extension_worker(rank, world, url, state, root, init, out):
    import torch.distributed as dist

    import weightcast
    from vllm_standin import Config, Engine, Trainer
    from weightcast.vllm import WorkerExtension

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    c = Config()

    class Runner:
        def __init__(self):
            self.engine = Engine(c, world, rank)

        def get_model(self):
            return self.engine

    class Worker(WorkerExtension):  # what vLLM's worker class becomes with the extension
        model_runner = Runner()

    w = Worker()
    trainer = Trainer(c) if rank == 0 else None
    pub = weightcast.Publisher(url, state_dir=state, anchor_every=100) if rank == 0 else None
    # No vLLM here: group "tp" is the world; the first rank follows for the node.
    assert w.weightcast_init(url, mode="node", root=root) is None
    assert w.weightcast_update() is None, "nothing published yet"
    reports = []
    for v in range(3):
        _publish(rank, trainer, pub, v, out)
        dist.barrier()
        r = w.weightcast_update(timeout=5)
        reports.append(r)
        assert r["committed"] and r["version"] == v and r["versions"] == [v] * world, r
        assert w.weightcast_version() == v
        truth = torch.load(os.path.join(out, f"truth-{v}.pt"))
        fresh = Engine(c, world, rank)
        fresh.load_weights(iter(truth.items()))
        got = dict(w.model_runner.get_model().named_parameters())
        for name, p in fresh.named_parameters():
            assert torch.equal(got[name].data.view(-1).view(torch.int16),
                               p.data.view(-1).view(torch.int16)), f"{name} at version {v}"
    assert [r["op"] for r in reports] == ["load", "patch", "patch"], reports
    assert w.weightcast_catch_up() == 2
    _close(dist)


def test_the_vllm_worker_extension_follows_as_one_node(bucket):
    """``WorkerExtension.weightcast_init(url, mode="node")``: the workers of
    one engine follow together, one download per node, through the same
    collective steps ``collective_rpc`` drives."""
    import torch.multiprocessing as mp

    url, state = bucket
    root = f"/dev/shm/weightcast-test-{os.getpid()}-vllm"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        try:
            mp.spawn(_vllm_extension_worker,
                     args=(2, url, state, root, f"tcp://127.0.0.1:{port}", out),
                     nprocs=2, join=True)
        finally:
            import shutil

            shutil.rmtree(root, ignore_errors=True)


def _killed_worker(rank, world, url, state, root, init, out, phase):
    import datetime
    import signal

    import torch.distributed as dist

    import weightcast
    from vllm_standin import Config, Engine, Trainer
    from weightcast.node import TensorParallelFollower

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    c = Config()
    engine = Engine(c, world, rank)
    params = dict(engine.named_parameters())

    def die(h):
        if rank == 1 and h.version == 1:
            os.kill(os.getpid(), signal.SIGKILL)

    hooks = {"fail_prepare": die} if phase == "prepare" else {"fail_commit": die}
    f = TensorParallelFollower(url if rank == 0 else None, params, engine.load_weights,
                               root=root, **hooks)
    trainer = Trainer(c) if rank == 0 else None
    pub = weightcast.Publisher(url, state_dir=state, anchor_every=100) if rank == 0 else None
    for v in range(2):
        _publish(rank, trainer, pub, v, out)
        dist.barrier()
        r = f.step()
    # Rank 1 died in this version's prepare or commit; rank 0 survived it.
    assert rank == 0
    assert not r.consistent() and r.versions[1] is None and "lost a rank" in r.failures[0], r
    held = 0 if phase == "prepare" else 1
    assert r.committed == (phase == "commit") and r.versions[0] == held, r
    truth = torch.load(os.path.join(out, f"truth-{held}.pt"))
    fresh = Engine(c, world, rank)
    fresh.load_weights(iter(truth.items()))
    for name, p in fresh.named_parameters():
        assert torch.equal(params[name].data.view(-1).view(torch.int16),
                           p.data.view(-1).view(torch.int16)), f"{name}: not version {held}"
    assert f.node.version == held, "the node's host copy moves with the ranks, or not at all"
    with pytest.raises(weightcast.Unavailable, match="lost a rank"):
        f.step()
    with open(os.path.join(out, "survivor.json"), "w") as fh:
        json.dump({"versions": r.versions, "committed": r.committed}, fh)
    os._exit(0)  # the group is broken: no orderly teardown


def _restarted_worker(rank, world, url, root, init, out):
    import torch.distributed as dist

    from vllm_standin import Config, Engine
    from weightcast.node import TensorParallelFollower

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    c = Config()
    engine = Engine(c, world, rank)
    params = dict(engine.named_parameters())
    f = TensorParallelFollower(url if rank == 0 else None, params, engine.load_weights,
                               root=root)
    for _ in range(4):
        r = f.step()
        if r.committed and r.version == 1 and r.op is not None:
            break
    assert r.consistent() and r.versions == [1] * world, r
    truth = torch.load(os.path.join(out, "truth-1.pt"))
    fresh = Engine(c, world, rank)
    fresh.load_weights(iter(truth.items()))
    for name, p in fresh.named_parameters():
        assert torch.equal(params[name].data.view(-1).view(torch.int16),
                           p.data.view(-1).view(torch.int16)), name
    _close(dist)


@pytest.mark.parametrize("phase", ["prepare", "commit"])
def test_a_rank_killed_mid_version_leaves_the_survivors_whole(bucket, tmp_path, phase):
    """A rank SIGKILLed in its prepare (before the vote: nobody commits,
    the survivor keeps the previous version exactly) or after voting, just
    before its commit (the survivor commits the version every rank
    prepared): the survivor's step reports the lost rank instead of hanging,
    later steps refuse, and a restarted group follows to the newest version
    bit-identically."""
    import multiprocessing

    import torch.multiprocessing as mp

    url, state = bucket
    root = f"/dev/shm/weightcast-test-{os.getpid()}-killed-{phase}"

    def port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    ctx = multiprocessing.get_context("spawn")
    init = f"tcp://127.0.0.1:{port()}"
    try:
        procs = [ctx.Process(target=_killed_worker,
                             args=(r, 2, url, state, root, init, str(tmp_path), phase))
                 for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=240)
        codes = [p.exitcode for p in procs]
        for p in procs:
            if p.is_alive():
                p.kill()
        assert codes == [0, -9], f"exit codes {codes} (rank 0 must survive, rank 1 was killed)"
        got = json.load(open(tmp_path / "survivor.json"))
        assert got["committed"] == (phase == "commit"), got
        mp.spawn(_restarted_worker, args=(2, url, root, f"tcp://127.0.0.1:{port()}", str(tmp_path)),
                 nprocs=2, join=True)
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)


def test_stripe_checksums_are_the_blake3_of_each_stripe(tmp_path):
    import hashlib

    from weightcast import _native

    # 10,496 bytes that do not repeat: stripes of 4096, 4096 and 2304
    data = b"".join(hashlib.sha256(b"%d" % i).digest() for i in range(328))
    f = tmp_path / "blob"
    f.write_bytes(data)
    alone = []
    for i in range(3):
        part = tmp_path / f"part{i}"
        part.write_bytes(data[i * 4096:(i + 1) * 4096])
        alone.append(_native.file_blake3(str(part)))
    assert _native.file_blake3_stripes(str(f), 4096, [0, 1, 2]) == alone
    assert _native.file_blake3_stripes(str(f), 4096, [2, 0]) == [alone[2], alone[0]]
    assert len(set(alone)) == 3
    with pytest.raises(Exception, match="stripe 3 .* past its end"):
        _native.file_blake3_stripes(str(f), 4096, [3])
    with pytest.raises(Exception, match="no-such-file"):
        _native.file_blake3_stripes(str(tmp_path / "no-such-file"), 4096, [0])


def test_gather_words_takes_the_words_at_positions_and_refuses_what_does_not_fit():
    import numpy as np

    from weightcast import _native

    src = np.arange(100_000, dtype=np.uint16) * 3
    pos = np.array([0, 7, 99_999, 40_000] * 20_000, dtype=np.uint32)  # several chunks
    pos64 = pos.astype(np.uint64)
    out, out64 = np.zeros(pos.size, np.uint16), np.zeros(pos.size, np.uint16)

    def item(name, p, o, source=src):
        return (name, source.ctypes.data, source.nbytes, p.ctypes.data, p.size, p.itemsize, 2,
                o.ctypes.data)

    _native.gather_words([item("a", pos, out), item("b", pos64, out64)])
    assert np.array_equal(out, src[pos.astype(np.intp)])
    assert np.array_equal(out64, out)
    # (every array the call reads or writes is named here, alive through
    # the call: the library takes addresses, not owners)
    past, short = np.array([5, 100_000], dtype=np.uint32), np.zeros(2, np.uint16)
    with pytest.raises(Exception, match="`w`: changed position 100000 is past its 100000 words"):
        _native.gather_words([item("w", past, short)])
    # an output over the source (or positions) is refused, not raced
    with pytest.raises(Exception, match="output overlaps"):
        _native.gather_words([item("x", pos[:10], src[:10])])


def test_scatter_words_writes_ascending_positions_and_refuses_the_rest():
    import numpy as np

    from weightcast import _native

    rng = np.random.default_rng(5)
    dst = rng.integers(0, 2**16, 300_000, dtype=np.uint16)
    want = dst.copy()
    pos = np.sort(rng.choice(dst.size, 100_000, replace=False)).astype(np.uint32)  # 4 stretches
    new = rng.integers(0, 2**16, pos.size, dtype=np.uint16)
    want[pos.astype(np.intp)] = new

    def item(name, p, words, target=dst):
        return (name, target.ctypes.data, target.nbytes, p.ctypes.data, p.size, p.itemsize,
                words.itemsize, words.ctypes.data)

    _native.scatter_words([item("a", pos, new)])
    assert np.array_equal(dst, want)
    # (every array the call reads or writes is named here, alive through
    # the call: the library takes addresses, not owners)
    wide, flipped = pos.astype(np.uint64), new ^ 1
    _native.scatter_words([item("b", wide, flipped)])
    assert np.array_equal(dst[pos.astype(np.intp)], flipped)
    for bad in ([5, 300_000], [9, 3]):  # past the end; out of order
        bad_pos = np.array(bad, np.uint32)
        with pytest.raises(Exception, match="`w`: changed position .* out of order or past"):
            _native.scatter_words([item("w", bad_pos, new)])
    descending = np.concatenate([pos[40_000:], pos[:40_000]])  # crosses stretches
    with pytest.raises(Exception, match="out of order"):
        _native.scatter_words([item("d", descending, new)])
    with pytest.raises(Exception, match="output overlaps"):
        _native.scatter_words([item("x", pos[:10], dst[:10])])


def test_a_ranks_stretches_of_the_patch_are_packed_aligned_and_found_again():
    """The plan of the copies that take a rank's stretches of the patch to
    its GPU (run on the CPU here: the copies are emulated with numpy)."""
    import numpy as np

    from weightcast.node import _fill_piece, _pack_plan

    blob = np.arange(1 << 20, dtype=np.uint64).view(np.uint8)  # 8 MiB, every byte known
    ranges = [(8, 4000), (4012, 6), (200_004, 4 * 1000), (200_004, 4 * 1000),
              (3_000_002, 2 * 777), (8_000_000, 0), (5_000_000, 2 * 100_000)]
    copies, moved, total = _pack_plan(ranges)
    dev = np.zeros(total, np.uint8)
    for a, b, to in copies:
        dev[to: to + b - a] = blob[a:b]
    for off, n in ranges:
        at, m = moved[(off, n)]
        assert m == n and at % 8 == off % 8, (off, n, at)
        assert np.array_equal(dev[at: at + n], blob[off: off + n]), (off, n)
    # close ranges travel together; far ones apart; less than the file
    assert len(copies) == 4, copies
    assert total < blob.nbytes // 2
    # The upload lays the same bytes out a piece at a time (pieces that cut
    # stretches anywhere, a stretch over many pieces, pieces with none).
    for piece in (1, 7, 4096, 65_536, 1 << 20, total, total + 1):
        pieced = np.zeros(total, np.uint8)
        buf, i = np.zeros(piece, np.uint8), 0
        for start in range(0, total, piece):
            end = min(total, start + piece)
            buf[:] = 0xAA  # what a reused buffer holds: overwritten where it counts
            i = _fill_piece(buf, blob, copies, i, start, end)
            pieced[start:end] = buf[: end - start]
        assert i == len(copies), piece
        for off, n in ranges:
            at, m = moved[(off, n)]
            assert np.array_equal(pieced[at: at + n], blob[off: off + n]), (piece, off, n)


def _host_gone_worker(rank, world, url, state, root, init, out):
    import torch.distributed as dist

    import weightcast
    from vllm_standin import Config, Engine, Trainer
    from weightcast.node import TensorParallelFollower

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    c = Config()
    engine = Engine(c, world, rank)
    params = dict(engine.named_parameters())
    removed = []

    def at_commit(h):
        # version 3: the host copy removed after every rank prepared, just
        # before the commit (the ranks commit; the node has nothing to write)
        if rank == 0 and h.version == 3 and h.op == "patch" and not removed:
            removed.append(h.version)
            os.remove(os.path.join(root, "state.bin"))

    follower = TensorParallelFollower(url if rank == 0 else None, params, engine.load_weights,
                                      root=root, fail_commit=at_commit)
    trainer = Trainer(c) if rank == 0 else None
    pub = weightcast.Publisher(url, state_dir=state, anchor_every=100) if rank == 0 else None
    events = []
    for v in range(5):
        if rank == 0:
            if v:
                trainer.step()
            truth = trainer.state()
            pub.publish(truth, step=v)
            torch.save(truth, os.path.join(out, f"truth-{v}.pt"))
            if v == 2:  # the node's shared memory cleaned up under it
                os.remove(os.path.join(root, "state.bin"))
        dist.barrier()
        for _ in range(3):
            r = follower.step()
            events.append([r.op, r.version, r.committed, r.versions])
            assert r.consistent(), r
            if r.committed and r.version == v:
                break
        _assert_like_a_fresh_load(params, out, v, world, rank)
    with open(os.path.join(out, f"gone-{rank}.json"), "w") as f:
        json.dump({"events": events,
                   "downloaded": follower.node.downloaded if rank == 0 else None}, f)
    _close(dist)


def test_a_host_copy_removed_under_the_node_is_rebuilt_from_the_bucket(bucket, tmp_path):
    _spawn(_host_gone_worker, 2, bucket, f"/dev/shm/weightcast-test-gone-{os.getpid()}",
           str(tmp_path))
    events = json.load(open(tmp_path / "gone-0.json"))["events"]
    assert events == json.load(open(tmp_path / "gone-1.json"))["events"]
    # Version 2 came as a rebuild: every rank loaded it from the new host
    # copy (the bit-identity checks ran in the workers). Version 3 was
    # committed by the ranks while the copy vanished under the node; the
    # next step rebuilt it (a load) before 4 went through as a patch.
    ops = [e[:3] for e in events]
    assert ops[:4] == [["load", 0, True], ["patch", 1, True], ["load", 2, True],
                       ["patch", 3, True]], events
    assert ops[4][0] == "load" and ops[4][2] and ops[-1] == ["patch", 4, True], events
    assert all(e[3] == [e[1]] * 2 for e in events), events


def test_a_hand_off_index_pointing_past_its_patch_is_refused(tmp_path):
    """Every range an index entry names must lie in the patch: the ranks
    and the node lend those ranges to the library by address."""
    import hashlib

    from weightcast import _native
    from weightcast.node import Handoff, _read_patch

    blob = tmp_path / "patch.bin"
    blob.write_bytes(bytes(range(256)) * 4)  # 1024 bytes; 64 changes of (8, 2, 2) bytes
    good = {"n": 64, "pw": 8, "wb": 2, "pos": 0, "old": 512, "new": 896}  # new ends at 1024

    def handoff(entry):
        meta = {"version": 7, "base": 6, "tensors": {"w": entry}, "size": 1024, "stripe": 512,
                "stripes": _native.file_blake3_stripes(str(blob), 512, [0, 1])}
        raw = json.dumps(meta).encode()
        (tmp_path / "patch.json").write_bytes(raw)
        return Handoff("patch", 7, 6, str(tmp_path), hashlib.sha256(raw).hexdigest())

    assert _read_patch(handoff(good))["tensors"]["w"] == good
    for bad in ({"new": 897}, {"n": 65}, {"pos": -8}, {"old": 512.0}, {"wb": 3}, {"pw": 2}):
        assert _read_patch(handoff({**good, **bad})) is None, bad
