"""weightcast: ship policy weights from a trainer to rollout engines through
object storage, bit-identically — from Python.

- :class:`Publisher` publishes a mapping of tensors (torch, CPU or CUDA, or
  numpy) from memory as the next version, exactly as ``weightcast publish``
  would: same bucket, same objects, readable by the CLI subscriber.
- :class:`Subscriber` follows a bucket; each :class:`Update` it returns is
  one version step (a delta) or an anchor, and :meth:`Update.apply_to`
  patches an engine's own tensors in place: every element the delta changes
  is checked to hold exactly the value the delta was made from before
  anything is written (the format's additive digests, at a cost
  proportional to the changes); otherwise it raises :class:`BaseMismatch`
  (or another :class:`Error`) and writes nothing.

The Rust library is the one implementation of the format, the store protocol
and the verification; this package is a thin binding over it. Network and
codec work run with the GIL released. Progress and errors are logged to the
``weightcast`` logger (the library's own events under ``weightcast.*``).
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from . import _device, _diff, _errors, _native
from ._errors import (
    BadRequest,
    BaseMismatch,
    ConfigError,
    Conflict,
    Corrupt,
    Error,
    IoError,
    NotFound,
    Unavailable,
)
from ._tensors import (
    Raw, from_bytes, group_files, is_torch, lend, lend_all, on_cpu, untie, word_view,
)

__all__ = [
    "Publisher",
    "Subscriber",
    "Update",
    "Raw",
    "run_hooks",
    "tensor_digest",
] + _errors.__all__

__version__ = _native.__version__

logger = logging.getLogger("weightcast")

Tensors = Mapping[str, Any]
FileBody = Union[bytes, bytearray, str, "os.PathLike[str]"]


def _store_options(options: Optional[Mapping[str, str]]) -> List[Tuple[str, str]]:
    return [(str(k), str(v)) for k, v in (options or {}).items()]


class Publisher:
    """Publishes tensors from memory as the next version of a store prefix.

    ``store_url`` is any store the CLI takes (``file:///dir``, ``s3://b/p``,
    ``gs://``, ``az://``, ``hf://buckets/ns/b``, ``memory://``); credentials
    come from the usual environment variables or ``store_options`` (the
    library's configuration keys, e.g. ``{"aws_endpoint": ...}``).
    ``state_dir`` keeps the snapshot of the last committed version, so a
    restarted trainer continues the chain.

    Options (the ``weightcast publish`` flags): ``encoding`` (``compact``,
    ``compact2`` — coded against the previous delta's changes, which
    subscribers keep — or ``trl``), ``compact2_max_density`` (with
    ``compact2``: a file whose step changed a larger share of its elements
    is written in ``compact``, faster there; 1 keeps ``compact2`` at every
    density; the library's default, 0.1, when not given), ``anchor_every`` (an anchor at least every N versions),
    ``anchor_encoding`` (``planes`` or ``raw``), ``single_writer``,
    ``keep_anchors`` (collect older versions after each anchor),
    ``notify_urls`` and ``notify_key`` (signed notifications to subscribers).

    A trainer of ``world`` hosts publishes each step as one version: every
    rank creates its own ``Publisher(..., rank=r, world=w)`` with its own
    ``state_dir`` and publishes its own shard files with the same ``step``
    (required); the version is committed once all ranks have uploaded
    (``weightcast publish --rank R --world W``, waiting up to
    ``rank_timeout`` seconds for the others).

    ``diff_on_device`` (CUDA tensors, ``compact``, one rank): the publisher
    keeps a copy of the last committed version on the tensors' device,
    compares there, and moves only the changes to the host, so a delta costs
    less than copying the model off the GPU. ``None`` (the default) does so
    when the copy leaves at least a tenth of the device (and 1 GiB) free;
    ``False`` never (every publish copies the tensors to pinned host memory
    and diffs there); ``True`` always, CPU tensors included. Anchors and any
    version the changes cannot make (see ``Publisher::publish_changes``) go
    the full way, which takes a fresh copy.
    """

    def __init__(
        self,
        store_url: str,
        state_dir: Union[str, "os.PathLike[str]"] = "weightcast-state",
        *,
        encoding: str = "compact",
        anchor_every: int = 10,
        anchor_encoding: str = "planes",
        single_writer: bool = False,
        keep_anchors: Optional[int] = None,
        notify_urls: Sequence[str] = (),
        notify_key: Optional[str] = None,
        store_options: Optional[Mapping[str, str]] = None,
        rank: Optional[int] = None,
        world: int = 1,
        rank_timeout: float = 600.0,
        diff_on_device: Optional[bool] = None,
        compact2_max_density: Optional[float] = None,
    ) -> None:
        self.store_url = store_url
        self.diff_on_device = diff_on_device
        self._changes_ok = encoding == "compact" and int(world) == 1
        self._base = _diff.DeviceBase()
        #: Timings of the last publish's phases. ``path``: ``device`` (changes
        #: found on the device: ``device_diff_s``, ``to_host_s`` for the changes,
        #: ``encode_s`` in the library) or ``host`` (``to_host_s`` for the
        #: tensors, ``diff_s`` in the library); ``native_s``: the library's
        #: whole publish (diff, upload, commit, snapshot).
        self.last_phases: Dict[str, Any] = {}
        self._native = _native.NativePublisher(
            store_url,
            os.fspath(state_dir),
            encoding,
            int(anchor_every),
            anchor_encoding,
            bool(single_writer),
            keep_anchors,
            list(notify_urls),
            notify_key,
            _store_options(store_options),
            rank,
            int(world),
            float(rank_timeout),
            None if compact2_max_density is None else float(compact2_max_density),
        )
        # Pinned host buffers reused for CUDA tensors, by (file, name).
        self._staging: Dict[Tuple[str, str], Any] = {}
        self._tied: Dict[str, Dict[str, str]] = {}

    @property
    def version(self) -> Optional[int]:
        """The last committed version this publisher knows of."""
        return self._native.version

    def _host(self, file: str, name: str, t: Any) -> Any:
        """A CPU copy of a device tensor, in a pinned buffer kept for the next
        publish when pinning is possible."""
        import torch

        key = (file, name)
        buf = self._staging.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            try:
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            except RuntimeError:
                buf = torch.empty(t.shape, dtype=t.dtype)
            self._staging[key] = buf
        buf.copy_(t.detach(), non_blocking=buf.is_pinned())
        return buf

    def publish(
        self,
        tensors: Tensors,
        files: Optional[Mapping[str, FileBody]] = None,
        step: Optional[int] = None,
        *,
        file_name: str = "model.safetensors",
    ) -> Dict[str, Any]:
        """Publishes ``tensors`` as the next version and returns the report
        ``weightcast publish`` prints (``version``, ``kind``, ``bytes``,
        ``changed``, ``total``, ...).

        ``tensors`` maps names to torch tensors (any device, any safetensors
        dtype), numpy arrays or :class:`Raw`; they form one tensor file
        ``file_name``, or pass ``{file: {name: tensor}}`` for several.
        CPU tensors are read in place (do not modify them until this
        returns); CUDA tensors are compared on their device with the copy
        of the last version (``diff_on_device``), or copied to pinned host
        memory first.
        ``files`` adds other files (config, tokenizer): bytes, or a path to
        read. ``step`` is the trainer's step, which must increase.

        It returns at the commit: notifications to subscribers go out in
        the background (the report has no ``notified``); a process that
        exits right after publishing calls :meth:`notifications_settled`.
        """
        groups = group_files(tensors, file_name)
        untied: Dict[str, Mapping[str, Any]] = {}
        for file, group in groups.items():
            group, tied = untie(group)
            if tied and tied != self._tied.get(file):
                # Published once, under the first name: writing it in an
                # engine whose names share the storage writes them all.
                logger.info("%s: tied tensors published once: %s", file,
                            ", ".join(f"{a} -> {k}" for a, k in sorted(tied.items())))
                self._tied[file] = tied
            untied[file] = group
        bodies = []
        for name, body in (files or {}).items():
            if isinstance(body, (bytes, bytearray, memoryview)):
                bodies.append((name, bytes(body)))
            else:
                with open(body, "rb") as f:
                    bodies.append((name, f.read()))
        diffable = self._changes_ok and _diff.DeviceBase.eligible(untied, self.diff_on_device)
        if diffable and self._base.matches(untied, self._native.version):
            out = self._publish_changes(untied, bodies, step)
            if out is not None:
                return out
        keep_copy = diffable and (self.diff_on_device is True or _diff.DeviceBase.fits(untied))
        return self._publish_full(untied, bodies, step, keep_copy)

    def _publish_changes(self, untied: Mapping[str, Mapping[str, Any]],
                         bodies: List[Tuple[str, bytes]], step: Optional[int]
                         ) -> Optional[Dict[str, Any]]:
        """The version from its changes, found on the device against the
        copy of the last one; ``None`` when it must go the full way."""
        specs, phases = self._base.changes(untied)
        started = time.perf_counter()
        out = json.loads(self._native.publish_changes(specs, bodies, step))
        phases["native_s"] = time.perf_counter() - started
        if "needs_full" in out:
            logger.info("publishing in full: %s", out["needs_full"])
            self._base.drop()
            return None
        if not out.get("unchanged"):
            self._base.advance(out["version"])
        self.last_phases = {"path": "device", **phases, "encode_s": out.get("diff_s")}
        logger.info(
            "published version %s (%s) from changes found on the device: %s bytes, %s of %s "
            "elements changed; diff %.3f s, to host %.3f s, library %.3f s",
            out.get("version"), out.get("kind"), out.get("bytes"), out.get("changed"),
            out.get("total"), phases["device_diff_s"], phases["to_host_s"], phases["native_s"],
        )
        return out

    def _publish_full(self, untied: Mapping[str, Mapping[str, Any]],
                      bodies: List[Tuple[str, bytes]], step: Optional[int],
                      keep_copy: bool) -> Dict[str, Any]:
        specs = []
        keep: List[Any] = []
        synced = False
        t0 = time.perf_counter()
        for file, group in untied.items():
            lst = []
            for name, t in group.items():
                if not on_cpu(t):
                    t = self._host(file, str(name), t)
                    synced = True
                spec, owner = lend(str(name), t, write=False)
                lst.append(spec)
                keep.append(owner)
            specs.append((file, lst))
        # The copy to diff the next version against, queued after the host
        # copies: both see the same words.
        copy = self._base.take(untied) if keep_copy else None
        if not keep_copy:
            self._base.drop()
        if synced:
            import torch

            if torch.cuda.is_available():
                torch.cuda.synchronize()
        started = time.perf_counter()
        try:
            out = json.loads(self._native.publish(specs, [(n, b) for n, b in bodies], step))
        except BaseException:
            self._base.drop()
            raise
        if copy is not None:
            self._base.adopt(copy, out["version"])
        self.last_phases = {"path": "host", "to_host_s": started - t0,
                            "native_s": time.perf_counter() - started, "diff_s": out.get("diff_s")}
        logger.info(
            "published version %s (%s): %s bytes, %s of %s elements changed in %.3f s",
            out.get("version"), out.get("kind"), out.get("bytes"), out.get("changed"),
            out.get("total"), time.perf_counter() - started,
        )
        return out

    def notifications_settled(self) -> int:
        """Waits until the notifications of every version published so far
        are delivered or given up (the library's bounded retries); returns
        how many subscribers acknowledged them."""
        return self._native.notifications_settled()


class Update:
    """One update from a :class:`Subscriber`: a delta (the version after the
    one the tensors hold) or an anchor (the full weights of a version).

    ``version`` equals what :meth:`Publisher.publish` returned for it;
    ``kind`` is ``"delta"`` or ``"anchor"``; ``base_version`` is the version
    a delta applies to (``None`` for an anchor).
    """

    def __init__(self, native: Any, subscriber: "Subscriber") -> None:
        self._native = native
        self._subscriber = subscriber
        self._applied: Optional[Tensors] = None
        self._changed: Optional[List[str]] = None
        self._prepared: Optional[Tuple[Tensors, str, Any, bool]] = None

    version = property(lambda self: self._native.version, doc="The version this update produces.")
    kind = property(lambda self: self._native.kind, doc="``delta`` or ``anchor``.")
    base_version = property(
        lambda self: self._native.base_version, doc="The version a delta applies to."
    )
    nbytes = property(
        lambda self: self._native.nbytes,
        doc="Bytes this update holds (deltas: the objects; anchors: the tensors).",
    )

    def __repr__(self) -> str:
        base = f" from {self.base_version}" if self.base_version is not None else ""
        return f"<weightcast.Update {self.kind} version {self.version}{base}>"

    def tensor_names(self) -> List[str]:
        """Tensors this update writes: the changed ones of a delta, every
        tensor of an anchor."""
        return [t[0] for t in self._native.tensors()]

    def apply_to(self, params: Union[Tensors, Any], *, via: str = "auto",
                 single_pass: bool = False) -> Dict[str, Any]:
        """Patches ``params`` (name → tensor, or a torch module, whose
        ``state_dict()`` is used) in place.

        A delta: before anything is written, every element the delta changes
        is checked to hold exactly its base value; a mismatch raises
        :class:`BaseMismatch` and nothing is modified (elements the delta
        does not change are not read; :meth:`Subscriber.verify` checks whole
        tensors). An anchor: every tensor of the version must be present with
        its dtype and shape (checked first), and is copied in.

        CPU tensors (torch or numpy) are patched through their memory by the
        library (``via="buffers"``); tensors on a device (CUDA) with a
        gather, a verification on the CPU, and a scatter on the device
        (``via="scatter"``, which also works on CPU tensors). ``"auto"``
        picks buffers when every tensor is on the CPU.

        ``single_pass=True`` (CPU tensors, one tensor file, after an anchor
        applied through this subscriber) applies a delta in one pass instead:
        decode, write, and check each tensor's digest at the end, putting
        every written word back if one fails (BaseMismatch) — ~1.4x shorter
        on CPU, but the tensors hold partial writes until it returns.
        Otherwise falls back to the verify-then-write apply.

        Returns a report (``version``, ``kind``, ``changed``,
        ``changed_tensors``, ``seconds``). The subscriber's version advances
        only when this succeeds.
        """
        params = self._untied(params)
        started = time.perf_counter()
        via = self._via(params, via)
        if via == "buffers":
            specs, keep = lend_all(params, write=True)
            report = json.loads(self._native.apply_buffers(specs, single_pass))
            del keep
        elif self.kind == "anchor":
            report = self._copy_anchor(params)
        else:
            report = self._scatter(params)
        return self._applied_report(report, via, params, started)

    def prepare(self, params: Union[Tensors, Any], *, via: str = "auto") -> bool:
        """Everything :meth:`apply_to` does before it writes, while the engine
        still serves from ``params``: a delta's bases verified (refusals as in
        :meth:`apply_to`, nothing modified) and its changes decoded (CPU
        tensors), or the old words gathered, verified and the new ones
        staged on the device (``via="scatter"``). :meth:`commit` then writes
        them: the engine pauses for the commit only, one scatter of the
        changed words. Nothing may write ``params`` between the two calls.

        Holds about 6 bytes per changed bf16 element until the commit (CPU
        tensors); on a device, 10 bytes per change there (the index and the
        new word), and pinned host buffers of 8 bytes per change are kept
        for the next version.
        Returns False when there was nothing to do ahead (an anchor, a
        TRL-encoded delta): :meth:`commit` then applies it whole."""
        params = self._untied(params)
        via = self._via(params, via)
        ready, staged = False, None
        if self.kind == "delta" and via == "buffers":
            specs, keep = lend_all(params, write=True)
            ready = self._native.prepare_buffers(specs)
            del keep
        elif self.kind == "delta":
            staged = self._stage_scatter(params)
            ready = True
        self._prepared = (params, via, staged, ready)
        logger.info("prepared %s version %s (%s): %s", self.kind, self.version, via,
                    "decoded, ready to commit" if ready else "applies whole at commit")
        return ready

    def commit(self) -> Dict[str, Any]:
        """Writes what :meth:`prepare` got ready into the same tensors (or
        applies the update whole when it returned False); returns the
        :meth:`apply_to` report, whose ``seconds`` is the pause."""
        if self._prepared is None:
            raise BadRequest(f"version {self.version}: commit() needs prepare(params) first")
        params, via, staged, ready = self._prepared
        if not ready:
            report = self.apply_to(params, via=via)
            self._prepared = None
            return report
        started = time.perf_counter()
        if via == "buffers":
            specs, keep = lend_all(params, write=True)
            report = json.loads(self._native.commit_prepared(specs))
            del keep
        else:
            report = self._write_staged(*staged)
        self._prepared = None  # a refused commit can be retried
        return self._applied_report(report, via, params, started)

    def _untied(self, params: Union[Tensors, Any]) -> Tensors:
        """``params`` with one name per storage (tied weights): the name this
        update writes is kept, so writing it writes every name of its
        storage."""
        return untie(_as_mapping(params), set(self.tensor_names()))[0]

    def _via(self, params: Tensors, via: str) -> str:
        if via not in ("auto", "buffers", "scatter"):
            raise BadRequest(f"via={via!r}: expected auto, buffers or scatter")
        if via == "auto":
            via = "buffers" if all(on_cpu(t) for t in params.values()) else "scatter"
        return via

    def _applied_report(self, report: Dict[str, Any], via: str, params: Tensors,
                        started: float) -> Dict[str, Any]:
        report["via"] = via
        report["seconds"] = time.perf_counter() - started
        self._applied = params
        self._changed = list(report["changed_tensors"])
        logger.info(
            "applied %s version %s in place (%s): %s changed in %.4f s",
            self.kind, self.version, via, report.get("changed"), report["seconds"],
        )
        return report

    def _scatter(self, params: Tensors) -> Dict[str, Any]:
        """Delta onto tensors anywhere: gather old words, let the library
        verify and resolve them, then scatter — only after every tensor
        resolved."""
        return self._write_staged(*self._stage_scatter(params))

    def _stage_scatter(self, params: Tensors) -> Tuple[List[Any], List[Any]]:
        """The scatter path up to the writes (``_device``): the old words
        gathered, the library's verification, the new words staged where
        the tensors live. Returns (writes, plan)."""
        from ._tensors import dtype_of, shape_of

        for name, dtype, shape in self._native.tensors():
            if name not in params:
                raise BaseMismatch(f"tensor `{name}` is changed by version {self.version} "
                                   "but is not among the tensors given")
            t = params[name]
            if (dtype_of(name, t), shape_of(t)) != (dtype, list(shape)):
                raise BaseMismatch(f"tensor `{name}` is {dtype_of(name, t)} {shape_of(t)}, the "
                                   f"delta is for {dtype} {list(shape)}")
        return _device.stage_delta(self._native, params, self._subscriber._staging)

    def _write_staged(self, writes: List[Any], plan: List[Any]) -> Dict[str, Any]:
        """The scatter path's writes, and the library's record of them."""
        _device.write(writes)
        self._native.commit_resolved()
        return {
            "version": self.version,
            "kind": "delta",
            "changed": int(sum(p[1] for p in plan)),
            "changed_tensors": [p[0] for p in plan if p[1]],
        }

    def _copy_anchor(self, params: Tensors) -> Dict[str, Any]:
        """Anchor onto tensors anywhere: every tensor checked, then copied."""
        from ._tensors import dtype_of, shape_of

        info = self._native.tensors()
        for name, dtype, shape in info:
            if name not in params:
                raise BadRequest(f"tensor `{name}` of version {self.version} is not among the "
                                 "tensors given")
            t = params[name]
            if (dtype_of(name, t), shape_of(t)) != (dtype, list(shape)):
                raise BaseMismatch(f"tensor `{name}` is {dtype_of(name, t)} {shape_of(t)}, "
                                   f"version {self.version} has {dtype} {list(shape)}")
        import ctypes

        # CUDA tensors: through the ring of pinned buffers.
        to_device = [(word_view(name, params[name], 1), *self._native.tensor_address(name))
                     for name, _d, _s in info
                     if is_torch(params[name]) and params[name].device.type == "cuda"]
        if to_device:
            _device.upload(to_device, self._subscriber._staging)
        for name, dtype, shape in info:
            t = params[name]
            if is_torch(t) and t.device.type == "cuda":
                continue
            # The staged anchor's memory read in place (no copy on the host):
            # valid until this update is committed, which follows.
            at, n = self._native.tensor_address(name)
            buf = (ctypes.c_uint8 * n).from_address(at) if n else bytearray()
            src = from_bytes(buf, dtype, list(shape), is_torch(t))
            if is_torch(t):
                t.detach().copy_(src)
            else:
                word_view(name, t, 1)[:] = word_view(name, src, 1)
            del src, buf
        self._native.commit_resolved()
        return {
            "version": self.version,
            "kind": "anchor",
            "changed": len(info),
            "changed_tensors": [i[0] for i in info],
        }

    def changed_tensors(self, params: Optional[Union[Tensors, Any]] = None) -> Iterator[Tuple[str, Any]]:
        """Yields ``(name, full new tensor)`` for every tensor this update
        changes, for engines that only load whole tensors.

        An anchor yields its own tensors (torch when torch is imported, else
        numpy; one copy at a time). A delta needs the base: pass ``params``
        (the host copy the engine loads from; it is patched in place with
        :meth:`apply_to` first) or call :meth:`apply_to` before; the tensors
        yielded are then ``params``' own.
        """
        if params is not None and self._applied is None:
            self.apply_to(params)
        if self._applied is not None:
            for name in self._changed or []:
                yield name, self._applied[name]
            return
        if self.kind == "delta":
            raise BadRequest(
                f"version {self.version} is a delta: its full tensors need the base; pass the "
                "tensors it applies to (changed_tensors(params)) or call apply_to first"
            )
        import sys

        prefer_torch = "torch" in sys.modules
        for name, dtype, shape in self._native.tensors():
            yield name, from_bytes(self._native.tensor_bytes(name), dtype, list(shape), prefer_torch)

    def files(self) -> Dict[str, bytes]:
        """The version's non-tensor files: all of them for an anchor, the
        changed ones for a delta."""
        return dict(self._native.files())

    def save_to(self, dir: Union[str, "os.PathLike[str]"], *, slots: int = 2) -> Dict[str, Any]:
        """Materializes this version in an output directory as ``weightcast
        subscribe --out DIR`` does (``DIR/current`` → a slot holding the
        checkpoint's files), replaying onto what ``DIR`` already holds when
        that is cheaper. Returns the catch-up report."""
        return json.loads(self._native.save_to(os.fspath(dir), slots))


class Subscriber:
    """Follows a bucket for an engine whose tensors it patches in place.

    ``version`` is the version the engine's tensors already hold (e.g.
    loaded from a ``weightcast subscribe`` output directory); ``None`` makes
    the first update an anchor. The subscriber's :attr:`version` advances
    only when an update's :meth:`Update.apply_to` succeeds; an apply that
    fails verification makes the next poll return an anchor update (repair).
    """

    def __init__(
        self,
        store_url: str,
        *,
        version: Optional[int] = None,
        poll_interval: float = 1.0,
        store_options: Optional[Mapping[str, str]] = None,
        listen: Optional[str] = None,
        notify_key: Optional[str] = None,
        advertise: Optional[str] = None,
        id: Optional[str] = None,
    ) -> None:
        """``listen`` (``HOST:PORT``; port 0 picks one) serves the
        subscriber's notify endpoint (``POST /v1/notify``, ``/v1/status``,
        ``/healthz``, ``/metrics``: the same server as ``weightcast subscribe
        --listen``) in the background, accepting notifications signed with
        ``notify_key``; :meth:`wait` then returns as soon as one arrives and
        polls only every ``poll_interval``. With ``id`` the subscriber
        registers in the bucket (``subscribers/<id>.json``, with its version,
        refreshed by :meth:`poll`) so that the publisher notifies it at
        ``advertise`` (default ``http://<bound address>/v1/notify``; required
        when ``listen`` is ``0.0.0.0`` or ``[::]``)."""
        self.store_url = store_url
        self.poll_interval = float(poll_interval)
        self._native = _native.NativeSubscriber(
            store_url, version, self.poll_interval, _store_options(store_options),
            listen, notify_key, advertise, id,
        )
        self.listening = listen is not None
        # Host buffers of the device path, reused from version to version.
        self._staging = _device.Staging()

    @property
    def version(self) -> Optional[int]:
        """The version the engine's tensors hold."""
        return self._native.version

    @property
    def newest(self) -> Optional[int]:
        """The newest version seen in the bucket."""
        return self._native.newest

    @property
    def requests(self) -> int:
        """Store requests made so far."""
        return self._native.requests

    @property
    def notify_url(self) -> Optional[str]:
        """The URL notifications reach this subscriber at (``None`` when it
        does not listen)."""
        return self._native.notify_url

    @property
    def notifications(self) -> int:
        """Notifications accepted so far."""
        return self._native.notifications

    def poll(self, *, anchor: bool = False, thorough: bool = False) -> Optional[Update]:
        """The next update, downloaded and checked against its manifest, or
        ``None`` when nothing is new. Cheap when nothing changed: one
        conditional GET of ``latest.json``. ``anchor=True`` asks for an
        anchor of the newest version (repair, or a fresh start);
        ``thorough=True`` lists the bucket instead of trusting the hint."""
        native = self._native.poll(thorough, anchor)
        if native is None:
            logger.debug("poll: nothing new after version %s", self.version)
            return None
        update = Update(native, self)
        logger.info("update ready: %s version %s (%s bytes)", update.kind, update.version,
                    update.nbytes)
        return update

    def wait(self, timeout: Optional[float] = None) -> Optional[Update]:
        """The next update, as soon as there is one, or ``None`` after
        ``timeout`` seconds (``None`` waits for ever). A listening subscriber
        returns when a notification arrives (then checks the bucket
        thoroughly) and otherwise polls every ``poll_interval``; one that
        does not listen polls, backing off from 50 ms to the poll
        interval. The GIL is released while it waits."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = self.poll_interval if self.listening else min(0.05, self.poll_interval)
        woken = False
        while True:
            update = self.poll(thorough=woken)
            if update is not None:
                return update
            step = delay
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                step = min(delay, left)
            woken = self._native.wait_notified(step)
            if woken:
                logger.debug("notified: checking the bucket")
            delay = min(delay * 2, self.poll_interval)

    def verify(self, params: Union[Tensors, Any]) -> Dict[str, Any]:
        """Full verification: every tensor's digest (a pass over all of it)
        against the digest recorded for the held version. Raises
        :class:`Corrupt` naming the first tensor that differs. Device tensors
        are copied to the CPU one at a time."""
        params = _as_mapping(params)
        specs, keep = [], []
        for name, t in params.items():
            if not on_cpu(t):
                t = t.detach().cpu()
            spec, owner = lend(str(name), t, write=False)
            specs.append(spec)
            keep.append(owner)
        return json.loads(self._native.verify(specs))


def _as_mapping(params: Any) -> Tensors:
    if isinstance(params, Mapping):
        return params
    state_dict = getattr(params, "state_dict", None)
    if callable(state_dict):
        return state_dict()
    raise BadRequest(f"expected a mapping of name to tensor or a torch module, got "
                     f"{type(params).__name__}")


Hook = Union[str, Callable[[Dict[str, Any]], Any]]


def run_hooks(hooks: Sequence[Hook], version: int, dir: Union[str, "os.PathLike[str]"],
              changed_tensors: Sequence[str] = (), *, timeout: Optional[float] = None,
              budget: Optional[float] = None, sglang_pause: Optional[str] = None,
              vllm_pause: Optional[str] = None) -> Dict[str, Any]:
    """Runs engine hooks for a version materialized in ``dir`` (e.g. by
    :meth:`Update.save_to`), as ``weightcast subscribe`` does after a
    switch: the library's kinds as strings (``sglang:URL``, ``vllm:URL``,
    ``webhook:URL``, ``command:CMD``) and Python callables, which receive
    the event (``version``, ``dir``, ``changed_tensors``). Failures are
    logged and counted, not raised. Returns ``pause_seconds`` (longest
    engine pause), ``failed`` and ``failures``. ``timeout`` (per request),
    ``budget`` (per hook, retries included), ``sglang_pause`` (``abort``,
    ``retract``, ``in_place``) and ``vllm_pause`` (``auto``, ``keep``,
    ``wait``, ``abort``) are the library's hook policy (``weightcast
    subscribe``'s defaults); the bearer tokens for servers started with
    ``--api-key`` come from ``WEIGHTCAST_VLLM_API_KEY`` and
    ``WEIGHTCAST_SGLANG_API_KEY``. A refused update (an error, or
    ``{"success": false}``) is a failure: the engine did not take the
    version."""
    event = {"version": version, "dir": os.fspath(dir), "changed_tensors": list(changed_tensors)}
    kinds = [h for h in hooks if isinstance(h, str)]
    report: Dict[str, Any] = {"pause_seconds": 0.0, "failed": 0}
    if kinds:
        report = json.loads(_native.run_hooks(kinds, version, event["dir"], event["changed_tensors"],
                                              timeout, budget, sglang_pause, vllm_pause))
    for h in hooks:
        if isinstance(h, str):
            continue
        started = time.perf_counter()
        try:
            h(dict(event))
        except Exception as e:  # a hook's failure must not undo the version
            logger.exception("hook %r failed for version %s", h, version)
            report["failed"] += 1
            report.setdefault("failures", []).append(
                {"hook": repr(h), "kind": "python", "attempts": 1, "message": repr(e)})
        else:
            report["pause_seconds"] = max(report["pause_seconds"], time.perf_counter() - started)
    return report


def tensor_digest(name: str, tensor: Any) -> str:
    """The library's full digest of one tensor (as headers record it)."""
    t = tensor if on_cpu(tensor) else tensor.detach().cpu()
    spec, keep = lend(name, t, write=False)
    return _native.tensor_digest(spec)


# The engine integrations are plain Python over the above (they import no
# engine package): weightcast.engine, weightcast.vllm, weightcast.sglang.
from . import engine, sglang, vllm  # noqa: E402
