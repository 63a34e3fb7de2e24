"""Following a bucket for an inference engine: the common part of the vLLM
and SGLang integrations (and of plain PyTorch serving loops).

Two ways to hand a version to an engine:

- **in place**: the engine's own tensors carry the checkpoint's names (plain
  PyTorch, Hugging Face ``transformers`` models): each update is applied to
  them directly (:meth:`weightcast.Update.prepare` while the engine serves,
  then :meth:`weightcast.Update.commit` in the pause), verified before
  anything is written, with no copy of the model.
- **through a loader**: the engine renames, fuses or shards tensors as it
  loads them (vLLM's ``model.load_weights``, SGLang's
  ``update_weights_from_tensor``). The follower keeps a host copy of the
  checkpoint's tensors, applies each delta to it in place (verified), and
  hands the loader only the tensors that changed — or, with ``patcher``
  (vLLM's ``load_checkpoint_weight_patches``), only the changed elements.

A loader that answers that it did not take the tensors — SGLang's
``(False, message)``, ``{"success": False, ...}`` or ``False`` — or raises,
leaves the engine without the version: :meth:`Follower.step` raises
:class:`EngineRefused`, :attr:`Follower.version` stays at the version the
engine confirmed, and the next step hands the same tensors again (from the
host copy, which holds the new version) before anything else.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Tuple

from . import Error, Subscriber, Update

logger = logging.getLogger("weightcast.engine")

Loader = Callable[[List[Tuple[str, Any]]], Any]


class Patch(NamedTuple):
    """One tensor's change in checkpoint coordinates: ``values`` (flat) at
    the flat ``indices`` of a tensor of ``shape`` and ``dtype`` (the
    checkpoint's), or the whole tensor (flat) when ``indices`` is None."""

    name: str
    shape: Tuple[int, ...]
    dtype: Any
    values: Any
    indices: Any = None


Patcher = Callable[[List[Patch]], Any]


class EngineRefused(Error):
    """The engine did not take a version's tensors (its loader answered a
    failure or raised). The version is not served: :attr:`Follower.version`
    stays at the previous one and the next :meth:`Follower.step` hands the
    same tensors again."""

    kind = "engine_refused"
    retryable = True


def refusal(result: Any) -> Optional[str]:
    """Why a loader's answer says it did not take the tensors, or None:
    ``(False, message)`` (SGLang's ``update_weights_from_tensor``),
    ``{"success": False, "message": ...}``, or ``False``."""

    def false(x: Any) -> bool:
        return type(x).__name__ in ("bool", "bool_") and not bool(x)

    if false(result):
        return "the engine answered False"
    if isinstance(result, (tuple, list)) and result and false(result[0]):
        return str(result[1]) if len(result) > 1 else "the engine answered (False,)"
    if isinstance(result, Mapping) and false(result.get("success", True)):
        return str(result.get("message", result))
    return None


class Follower:
    """A :class:`weightcast.Subscriber` bound to an engine.

    ``params`` (in place) is a mapping name → tensor or a torch module whose
    ``state_dict()`` shares its parameters' memory; ``loader`` (through a
    loader) is called with ``[(name, full tensor)]`` for the changed tensors
    of each version (every tensor after an anchor). Give one of them.
    ``patcher`` (with ``loader``) is called instead with a delta's
    floating-point changes as sparse :class:`Patch` es (flat indices and new
    values); the loader still takes anchors and other dtypes. ``version`` is
    what the engine already holds (``None``: the first update is an anchor).
    Other keyword arguments go to the Subscriber.
    """

    def __init__(
        self,
        store_url: str,
        *,
        params: Any = None,
        loader: Optional[Loader] = None,
        patcher: Optional[Patcher] = None,
        version: Optional[int] = None,
        **subscriber_options: Any,
    ) -> None:
        from ._errors import BadRequest

        if (params is None) == (loader is None):
            raise BadRequest("give either params (in place) or loader (through a loader)")
        if patcher is not None and loader is None:
            raise BadRequest("patcher needs a loader (anchors and non-float tensors load whole)")
        self.subscriber = Subscriber(store_url, version=version, **subscriber_options)
        self._params = params
        self._loader = loader
        self._patcher = patcher
        # The checkpoint's tensors on the host, for the loader path.
        self.host: Dict[str, Any] = {}
        self.last_report: Optional[Dict[str, Any]] = None
        # The version the engine confirmed, and what it still owes: the
        # version and the names its loader did not take.
        self._served: Optional[int] = version
        self._owed: Optional[Tuple[int, List[str]]] = None

    @property
    def version(self) -> Optional[int]:
        """The version the engine holds: the last one its loader took (a
        refused version is not counted until a later step hands it again)."""
        return self._served

    @property
    def owed(self) -> Optional[Tuple[int, List[str]]]:
        """``(version, names)`` the engine refused and is handed again by the
        next :meth:`step`, or None."""
        return self._owed

    def step(self, timeout: Optional[float] = 0.0) -> Optional[Dict[str, Any]]:
        """Waits up to ``timeout`` seconds for the next update (``0``: one
        poll) and hands it to the engine. Returns the apply report
        (``version``, ``kind``, ``changed``, ``pause_seconds``: from update
        downloaded to engine holding the version), or ``None``. A version
        the engine refused is handed again first (``kind`` ``"retry"``);
        raises :class:`EngineRefused` while the engine refuses."""
        if self._owed is not None:
            return self._retry()
        update = self.subscriber.poll() if timeout == 0 else self.subscriber.wait(timeout)
        if update is None:
            return None
        return self.apply(update)

    def catch_up(self, version: Optional[int] = None, timeout: float = 60.0) -> Optional[int]:
        """Applies updates until the engine holds ``version`` (``None``: the
        newest one seen) or ``timeout`` passes; returns the held version."""
        deadline = time.monotonic() + timeout
        while True:
            held = self.version
            if held is not None and version is not None and held >= version:
                return held
            left = deadline - time.monotonic()
            if left <= 0:
                return held
            if self.step(timeout=0 if version is None else min(left, 1.0)) is None and version is None:
                return self.version

    def apply(self, update: Update) -> Dict[str, Any]:
        """Hands one update to the engine (see the class). In place, the
        update is prepared first (verified and decoded while the engine
        still serves: ``prepare_seconds``) and the pause is the commit
        alone."""
        if self._owed is not None and update.kind != "anchor":
            # The engine must take the version it owes before a delta on top
            # (an anchor hands every tensor anyway).
            self._retry()
        prepare_seconds = 0.0
        if self._params is not None:
            t = time.perf_counter()
            update.prepare(self._params)
            prepare_seconds = time.perf_counter() - t
        started = time.perf_counter()
        if self._params is not None:
            report = update.commit()
        else:
            report = self._load(update, started)
        report["pause_seconds"] = time.perf_counter() - started
        report["prepare_seconds"] = prepare_seconds
        self._served = report["version"]
        self.last_report = report
        return report

    def _load(self, update: Update, started: float) -> Dict[str, Any]:
        patches: List[Patch] = []
        if update.kind == "anchor":
            fresh = {name: _own(t) for name, t in update.changed_tensors()}
            report = update.apply_to(fresh)  # records the version and digests
            self.host = fresh
            whole: List[str] = list(fresh)
        elif self._patcher is not None:
            report, patches, whole = self._apply_sparse(update, started)
        else:
            report = update.apply_to(self.host)
            whole = list(report["changed_tensors"])
        # The host copy holds the new version now: until the engine takes
        # every changed tensor, the version is owed.
        self._owed = (report["version"], sorted(set(whole) | {p.name for p in patches}))
        self._hand(whole, patches)
        self._owed = None
        return report

    def _hand(self, whole: List[str], patches: List[Patch]) -> None:
        """Hands the engine whole tensors and sparse patches; raises
        EngineRefused (keeping ``_owed``) when it does not take them."""
        assert self._loader is not None
        owed = self._owed
        try:
            results = []
            if patches:
                assert self._patcher is not None
                results.append(self._patcher(patches))
            if whole:
                results.append(self._loader([(name, self.host[name]) for name in whole]))
        except Exception as e:
            raise EngineRefused(
                f"the engine's loader failed for version {owed and owed[0]}: {e!r}; the version "
                "is not served and its tensors are handed again by the next step"
            ) from e
        for r in results:
            why = refusal(r)
            if why is not None:
                raise EngineRefused(
                    f"the engine refused version {owed and owed[0]}: {why}; the version is not "
                    "served and its tensors are handed again by the next step"
                )

    def _retry(self) -> Dict[str, Any]:
        """Hands an owed version again, whole (the host copy holds it)."""
        assert self._owed is not None
        version, names = self._owed
        started = time.perf_counter()
        self._hand(names, [])
        self._owed = None
        self._served = version
        report = {"version": version, "kind": "retry", "changed": len(names),
                  "changed_tensors": names, "pause_seconds": time.perf_counter() - started,
                  "prepare_seconds": 0.0}
        self.last_report = report
        logger.info("the engine took version %s on a retry", version)
        return report

    def _apply_sparse(self, update: Update,
                      started: float) -> Tuple[Dict[str, Any], List[Patch], List[str]]:
        """A delta onto the host copy through the scatter path, keeping the
        changed positions: floating-point tensors whose words are elements
        become sparse patches (values read back from the host copy, so
        already verified and written); the rest load whole."""
        import numpy as np
        import torch

        writes, plan = update._stage_scatter(self.host)
        report = update._write_staged(writes, plan)
        report = update._applied_report(report, "scatter", self.host, started)
        patches: List[Patch] = []
        whole: List[str] = []
        for (name, n, _pw, word_bytes, _po, _wo), (_words, idx, _new) in zip(plan, writes):
            if not n:
                continue
            t = self.host[name]
            flat = t.reshape(-1)
            if not (t.is_floating_point() and t.element_size() == word_bytes):
                whole.append(name)
                continue
            if not torch.is_tensor(idx):
                idx = torch.from_numpy(np.asarray(idx, dtype=np.int64))
            values = flat.index_select(0, idx)
            if bool(torch.isnan(values).any()):
                whole.append(name)  # NaN marks "unchanged" in a sparse patch
                continue
            patches.append(Patch(name, tuple(t.shape), t.dtype, values, idx))
        return report, patches, whole


def _own(t: Any) -> Any:
    """A tensor that owns writable memory (anchor tensors are views of a
    buffer the update keeps)."""
    clone = getattr(t, "clone", None)
    if callable(clone):
        return clone()
    copy = getattr(t, "copy", None)
    return copy() if callable(copy) else t


def state_dict_of(model: Any) -> Mapping[str, Any]:
    """``model.state_dict()`` without duplicates of tied tensors (one name
    per storage), for applying in place."""
    seen = set()
    out = {}
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), t.numel()) if t.numel() else (name,)
        if key in seen:
            continue
        seen.add(key)
        out[name] = t
    return out
