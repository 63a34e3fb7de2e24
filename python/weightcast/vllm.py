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
and sharded parameters). ``mode="inplace"`` instead patches the model's
parameters directly, for models whose parameter names and shapes are the
checkpoint's (no host copy, no load).

Call ``weightcast_update`` between generation steps (vLLM serializes RPCs
with the engine's steps); the pause is its ``pause_seconds``.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from .engine import Follower, state_dict_of


class WorkerExtension:
    """Mixed into vLLM's worker class; vLLM gives it ``self.model_runner``
    (whose ``model`` is the loaded model). Methods are called through
    ``collective_rpc``."""

    _weightcast: Optional[Follower] = None

    def _weightcast_model(self) -> Any:
        return self.model_runner.model  # type: ignore[attr-defined]

    def weightcast_init(
        self, store_url: str, mode: str = "load_weights", version: Optional[int] = None,
        **subscriber_options: Any,
    ) -> Optional[int]:
        """Starts following ``store_url``. ``mode``: ``load_weights``
        (default) or ``inplace``. ``version``: the version the loaded model
        already holds (``None``: the first update is an anchor). Returns the
        held version."""
        model = self._weightcast_model()
        if mode == "inplace":
            self._weightcast = Follower(store_url, params=state_dict_of(model), version=version,
                                        **subscriber_options)
        elif mode == "load_weights":
            self._weightcast = Follower(store_url, loader=lambda ws: model.load_weights(ws),
                                        version=version, **subscriber_options)
        else:
            from ._errors import BadRequest

            raise BadRequest(f"mode={mode!r}: expected load_weights or inplace")
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
