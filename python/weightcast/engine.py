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
  hands the loader only the tensors that changed.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

from . import Subscriber, Update

logger = logging.getLogger("weightcast.engine")

Loader = Callable[[List[Tuple[str, Any]]], Any]


class Follower:
    """A :class:`weightcast.Subscriber` bound to an engine.

    ``params`` (in place) is a mapping name → tensor or a torch module whose
    ``state_dict()`` shares its parameters' memory; ``loader`` (through a
    loader) is called with ``[(name, full tensor)]`` for the changed tensors
    of each version (every tensor after an anchor). Give one of them.
    ``version`` is what the engine already holds (``None``: the first update
    is an anchor). Other keyword arguments go to the Subscriber.
    """

    def __init__(
        self,
        store_url: str,
        *,
        params: Any = None,
        loader: Optional[Loader] = None,
        version: Optional[int] = None,
        **subscriber_options: Any,
    ) -> None:
        if (params is None) == (loader is None):
            from ._errors import BadRequest

            raise BadRequest("give either params (in place) or loader (through a loader)")
        self.subscriber = Subscriber(store_url, version=version, **subscriber_options)
        self._params = params
        self._loader = loader
        # The checkpoint's tensors on the host, for the loader path.
        self.host: Dict[str, Any] = {}
        self.last_report: Optional[Dict[str, Any]] = None

    @property
    def version(self) -> Optional[int]:
        """The version the engine holds."""
        return self.subscriber.version

    def step(self, timeout: Optional[float] = 0.0) -> Optional[Dict[str, Any]]:
        """Waits up to ``timeout`` seconds for the next update (``0``: one
        poll) and hands it to the engine. Returns the apply report
        (``version``, ``kind``, ``changed``, ``pause_seconds``: from update
        downloaded to engine holding the version), or ``None``."""
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
        prepare_seconds = 0.0
        if self._params is not None:
            t = time.perf_counter()
            update.prepare(self._params)
            prepare_seconds = time.perf_counter() - t
        started = time.perf_counter()
        if self._params is not None:
            report = update.commit()
        else:
            report = self._load(update)
        report["pause_seconds"] = time.perf_counter() - started
        report["prepare_seconds"] = prepare_seconds
        self.last_report = report
        return report

    def _load(self, update: Update) -> Dict[str, Any]:
        if update.kind == "anchor":
            fresh = {name: _own(t) for name, t in update.changed_tensors()}
            report = update.apply_to(fresh)  # records the version and digests
            self.host = fresh
            changed: Iterable[str] = list(fresh)
        else:
            report = update.apply_to(self.host)
            changed = report["changed_tensors"]
        assert self._loader is not None
        self._loader([(name, self.host[name]) for name in changed])
        return report


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
