"""The exceptions of weightcast.

Every failure of the library arrives as a subclass of :class:`Error`, chosen
by what the caller should do about it (the library's ``ErrorKind``). The
message is the library's: it names the object, tensor, field or setting at
fault and what to do.
"""

from __future__ import annotations

from typing import Optional

__all__ = [
    "Error",
    "NotFound",
    "Conflict",
    "Corrupt",
    "BaseMismatch",
    "BadRequest",
    "Unavailable",
    "ConfigError",
    "IoError",
]


class Error(Exception):
    """Base class of every weightcast error.

    ``kind`` is the library's classification (``not_found``, ``precondition``,
    ``corrupt``, ``bad_request``, ``unavailable``, ``config``, ``io``);
    ``retryable`` says whether the same call can succeed later.
    """

    kind: str = "error"
    retryable: bool = False

    def __init__(self, message: str, kind: Optional[str] = None) -> None:
        super().__init__(message)
        if kind is not None:
            self.kind = kind


class NotFound(Error):
    """Something named does not exist (an object, a version, a tensor)."""

    kind = "not_found"


class Conflict(Error):
    """A precondition failed: another writer committed first, a step is not
    newer than the last one, or the tensors moved to another version since
    the update was polled. Re-read the state and try again."""

    kind = "precondition"
    retryable = True


class Corrupt(Error):
    """Data from the bucket is malformed or fails verification. It was not
    used; the subscriber's next poll returns an anchor update to repair."""

    kind = "corrupt"


class BaseMismatch(Corrupt):
    """A delta does not apply to the tensors it was given: an element it
    changes does not hold the value the delta was made from (the tensors were
    modified, or hold another version), or a tensor's dtype or shape differs.
    Nothing was written; the next poll returns an anchor update."""


class BadRequest(Error, ValueError):
    """The caller's input is invalid (a tensor, an argument). Fix it; retrying
    as is fails again."""

    kind = "bad_request"


class Unavailable(Error):
    """The store or a peer is unreachable or failing: retry with backoff."""

    kind = "unavailable"
    retryable = True


class ConfigError(Error):
    """The configuration is wrong (store URL, credentials, an option)."""

    kind = "config"


class IoError(Error, OSError):
    """Local I/O failed (disk full, permissions, a directory vanished)."""

    kind = "io"
