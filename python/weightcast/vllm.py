"""vLLM integration: a worker extension that follows a weightcast bucket.

Start vLLM with ``--worker-extension-cls weightcast.vllm.WorkerExtension``
(or ``worker_extension_cls=`` in ``LLM(...)``); then, from the driver::

    llm.collective_rpc("weightcast_init", args=("s3://bucket/policy",))
    llm.collective_rpc("weightcast_update", kwargs={"timeout": 30})  # per version
    llm.collective_rpc("weightcast_version")                       # [version per worker]

Each worker follows the bucket itself: it downloads the next version (a
delta of a few percent of the model, or an anchor when it starts or falls
behind), applies it to a host copy of the checkpoint's tensors in place
(verified before anything is written), and loads **only the changed
tensors** through the model's own ``load_weights`` (which knows vLLM's fused
and sharded parameters). ``mode="sparse"`` hands a delta's changed
**elements** instead, through vLLM's ``load_checkpoint_weight_patches``
(``vllm.model_executor.model_loader.checkpoint_weight_patch``, vLLM PR
#50723), which still routes them through ``load_weights``.
``mode="inplace"`` patches the model's parameters directly, for models
whose parameter names and shapes are the checkpoint's (no host copy, no
load).

``mode="node"`` is for tensor-parallel engines: one download and one host
copy per node, every rank's fused and sharded parameters patched in place,
every rank on the same version (:mod:`weightcast.node`). The first worker of
the group (vLLM's tensor-parallel group, through its CPU/gloo group) follows
the bucket for the node and keeps the host copy in ``/dev/shm``; every worker
maps checkpoint coordinates to its own parameters by probing the model's
``load_weights`` once, verifies its share of each delta (old words), stages
it, and all commit or none. A layout it cannot map (quantized or FP8 kernel
formats) is refused by name at the first update: use ``load_weights`` for
that model. ``weightcast_update`` then returns the node's step report
(``versions`` per rank, ``failures``, ``pause_seconds``).

The model is ``self.model_runner.get_model()`` (vLLM's runner wraps the
model in CUDA-graph or micro-batching wrappers; ``get_model()`` unwraps it).

Call ``weightcast_update`` between generation steps (vLLM serializes RPCs
with the engine's steps); the pause is its ``pause_seconds``.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Callable, Dict, List, Optional

from .engine import Follower, Patch, state_dict_of

MODES = ("load_weights", "inplace", "sparse", "node")


def sparse_patch_api() -> Callable[[Any, List[Any]], Any]:
    """vLLM's ``load_checkpoint_weight_patches`` as ``apply(model,
    patches)``; ConfigError when this vLLM has none."""
    try:
        from vllm.model_executor.model_loader.checkpoint_weight_patch import (  # type: ignore
            CheckpointWeightPatch,
            load_checkpoint_weight_patches,
        )
    except ImportError as e:
        from ._errors import ConfigError

        raise ConfigError(
            "mode='sparse' needs vLLM's load_checkpoint_weight_patches "
            "(vllm.model_executor.model_loader.checkpoint_weight_patch, vLLM PR #50723), "
            f"which this vLLM lacks ({e}); use mode='load_weights'"
        ) from e

    def apply(model: Any, patches: List[Patch]) -> Any:
        device = next(iter(model.parameters())).device
        return load_checkpoint_weight_patches(model, [
            CheckpointWeightPatch(p.name, tuple(p.shape), p.dtype, p.values.to(device),
                                  None if p.indices is None else p.indices.to(device))
            for p in patches
        ])

    return apply


class WorkerExtension:
    """Mixed into vLLM's worker class; vLLM gives it ``self.model_runner``
    (whose ``get_model()`` is the loaded model). Methods are called through
    ``collective_rpc``."""

    _weightcast: Optional[Any] = None  # a Follower, or a TensorParallelFollower (mode="node")

    def _weightcast_model(self) -> Any:
        runner = self.model_runner  # type: ignore[attr-defined]
        get_model = getattr(runner, "get_model", None)
        return get_model() if callable(get_model) else runner.model

    def weightcast_init(
        self, store_url: str, mode: str = "load_weights", version: Optional[int] = None,
        **subscriber_options: Any,
    ) -> Optional[int]:
        """Starts following ``store_url``. ``mode``: ``load_weights``
        (default: changed tensors through ``model.load_weights``),
        ``sparse`` (a delta's changed elements through vLLM's
        ``load_checkpoint_weight_patches``; anchors and non-float tensors
        through ``load_weights``) or ``inplace``. ``version``: the version
        the loaded model already holds (``None``: the first update is an
        anchor). ``mode="node"`` takes ``root`` (node-local shared memory,
        default ``/dev/shm/weightcast-<hash of the URL and the group>``) and
        ``group`` (``"tp"``: vLLM's tensor-parallel group, the default where
        vLLM is importable; ``"world"``: every worker). Returns the held
        version."""
        if mode not in MODES:
            from ._errors import BadRequest

            raise BadRequest(f"mode={mode!r}: expected one of {', '.join(MODES)}")
        model = self._weightcast_model()
        if mode == "node":
            self._weightcast = _node_follower(store_url, model, **subscriber_options)
            return self.weightcast_version()
        if mode == "inplace":
            self._weightcast = Follower(store_url, params=state_dict_of(model), version=version,
                                        **subscriber_options)
            return self._weightcast.version
        patcher = None
        if mode == "sparse":
            apply = sparse_patch_api()
            patcher = lambda patches: apply(self._weightcast_model(), patches)  # noqa: E731
        self._weightcast = Follower(
            store_url, loader=lambda ws: self._weightcast_model().load_weights(ws),
            patcher=patcher, version=version, **subscriber_options)
        return self._weightcast.version

    def _weightcast_follower(self) -> Follower:
        if self._weightcast is None:
            from ._errors import BadRequest

            raise BadRequest("call weightcast_init(store_url) first")
        return self._weightcast

    def weightcast_update(self, timeout: float = 0.0) -> Optional[Dict[str, Any]]:
        """Applies the next version if one is ready within ``timeout``
        seconds; returns the report (``version``, ``kind``, ``changed``,
        ``pause_seconds``) or ``None``. With ``mode="node"`` every worker
        must call it (``collective_rpc`` does): the node's step report
        (``op``, ``version``, ``committed``, ``versions`` by rank,
        ``failures``, ``node_seconds``, ``prepare_seconds``,
        ``pause_seconds``), or ``None`` when nothing was new."""
        f = self._weightcast_follower()
        if isinstance(f, Follower):
            return f.step(timeout)
        r = f.step(timeout)
        return None if r.op is None and not any(r.failures) else dataclasses.asdict(r)

    def weightcast_catch_up(self, version: Optional[int] = None,
                            timeout: float = 60.0) -> Optional[int]:
        """Applies updates until the worker holds ``version`` (``None``: the
        newest); returns the held version."""
        f = self._weightcast_follower()
        if isinstance(f, Follower):
            return f.catch_up(version, timeout)
        # Every rank must take the same steps (each is collective): the loop
        # ends on what the step reports, which every rank sees alike, and
        # after a number of steps, not on each rank's own clock.
        held = f.version
        for _ in range(max(1, int(timeout))):
            r = f.step(0.0 if version is None else 1.0)
            held = r.versions[f.rank]
            if r.consistent() and held is not None and (
                    version is not None and held >= version or version is None and r.op is None):
                break
        return held

    def weightcast_version(self) -> Optional[int]:
        """The weight version this worker holds."""
        return None if self._weightcast is None else self._weightcast.version


def _node_group(group: str) -> Any:
    """The ``torch.distributed`` group whose ranks share a node's follower:
    vLLM's tensor-parallel group (its CPU, gloo, group: the object
    broadcasts and votes need no device), or the world."""
    if group == "world":
        return None
    if group != "tp":
        from ._errors import BadRequest

        raise BadRequest(f"group={group!r}: expected 'tp' or 'world'")
    try:
        from vllm.distributed.parallel_state import get_tp_group  # type: ignore
    except ImportError:
        return None  # no vLLM: the caller's world is the engine's group
    return get_tp_group().cpu_group


def _node_follower(store_url: str, model: Any, root: Optional[str] = None,
                   group: str = "tp", **subscriber_options: Any) -> Any:
    import torch.distributed as dist

    from .node import TensorParallelFollower

    g = _node_group(group)
    first = 0 if g is None else dist.get_global_rank(g, 0)
    if root is None:
        key = hashlib.blake2b(f"{store_url}\0{first}".encode(), digest_size=8).hexdigest()
        root = f"/dev/shm/weightcast-{key}"
    return TensorParallelFollower(
        store_url, dict(model.named_parameters()), model.load_weights, root=root, group=g,
        **subscriber_options)
