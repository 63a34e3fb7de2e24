"""SGLang integration: hand each version's changed tensors to an SGLang
engine through ``update_weights_from_tensor``.

In the process that owns the engine (``sglang.Engine`` offline, or next to
the server through its Python API)::

    follower = weightcast.sglang.follow(engine, "s3://bucket/policy")
    while serving:
        report = follower.step(timeout=30)   # None when nothing is new

The follower keeps a host copy of the checkpoint's tensors, applies each
delta to it in place (verified before anything is written) and passes SGLang
only the changed tensors; an anchor (first start, or after falling behind)
passes all of them. ``update_weights_from_tensor`` answers ``(success,
message)``: ``success`` False (or an exception) raises
:class:`weightcast.engine.EngineRefused`, the version is not counted as
served (:attr:`Follower.version` stays), and the next ``step`` hands the
same tensors again.

``flush_cache=True`` (SGLang's default) rebuilds SGLang's KV/radix cache
with the new weights, and SGLang asserts that the flush succeeds: it fails
with requests queued or running, killing the scheduler (SGLang #20296). Call
``step`` between ``generate`` calls, or with ``flush_cache=False`` while
requests are in flight (their cached prefixes then keep KV computed with the
old weights until evicted).

For an HTTP-only server, materialize the version with
:meth:`weightcast.Update.save_to` and use the ``sglang:URL`` hook
(:func:`weightcast.run_hooks`), as ``weightcast subscribe`` does.
"""

from __future__ import annotations

from typing import Any, Optional

from .engine import Follower


def follow(engine: Any, store_url: str, *, version: Optional[int] = None,
           flush_cache: bool = True, **subscriber_options: Any) -> Follower:
    """A :class:`weightcast.engine.Follower` loading through
    ``engine.update_weights_from_tensor(named_tensors, flush_cache=...)``,
    whose ``(success, message)`` it checks."""

    def load(named_tensors: Any) -> Any:
        return engine.update_weights_from_tensor(named_tensors, flush_cache=flush_cache)

    return Follower(store_url, loader=load, version=version, **subscriber_options)
