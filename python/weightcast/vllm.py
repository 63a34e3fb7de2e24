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

The model is ``self.model_runner.get_model()`` (vLLM's runner wraps the
model in CUDA-graph or micro-batching wrappers; ``get_model()`` unwraps it).

Call ``weightcast_update`` between generation steps (vLLM serializes RPCs
with the engine's steps); the pause is its ``pause_seconds``.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

from .engine import Follower, Patch, state_dict_of

MODES = ("load_weights", "inplace", "sparse")


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

    _weightcast: Optional[Follower] = None

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
        anchor). Returns the held version."""
        if mode not in MODES:
            from ._errors import BadRequest

            raise BadRequest(f"mode={mode!r}: expected one of {', '.join(MODES)}")
        model = self._weightcast_model()
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
        ``pause_seconds``) or ``None``."""
        return self._weightcast_follower().step(timeout)

    def weightcast_catch_up(self, version: Optional[int] = None,
                            timeout: float = 60.0) -> Optional[int]:
        """Applies updates until the worker holds ``version`` (``None``: the
        newest); returns the held version."""
        return self._weightcast_follower().catch_up(version, timeout)

    def weightcast_version(self) -> Optional[int]:
        """The weight version this worker holds."""
        return None if self._weightcast is None else self._weightcast.version
