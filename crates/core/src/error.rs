//! The library's typed error. Every failure names what was wrong and where
//! (which object, tensor, field, URL or setting), because the input is usually
//! untrusted bytes from a bucket and an operator has to act on the message.
//!
//! Errors are classified by **what the caller should do next**
//! ([`Error::kind`], as `object_store::Error` does): retry later, fix the
//! configuration, fix the request, repair from an anchor, resync. The HTTP
//! status of each kind ([`ErrorKind::http_status`]) and the process exit code
//! ([`ErrorKind::exit_code`]) are defined here and nowhere else, so the CLI
//! and both daemons answer the same failure the same way.

use thiserror::Error;

/// Result alias used across the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What the caller should do about an error.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// Something named does not exist (an object, a version, a file): check
    /// the name, or wait for it to be published.
    NotFound,
    /// A precondition failed: another writer committed first, a step is not
    /// newer than the last one, an object changed since it was read. Resync
    /// (re-read the state) and try again, or give up on this request.
    Precondition,
    /// Untrusted input (an object from the bucket, a notification) is
    /// malformed, corrupt or fails verification. Do not use it; repair from an
    /// anchor or wait for a good version.
    Corrupt,
    /// The caller's own request or input is invalid (a checkpoint, a request
    /// body, an argument). Fix it and send it again; retrying as is fails again.
    BadRequest,
    /// The store or a peer is unreachable, throttling or failing: transient,
    /// retry with backoff.
    Unavailable,
    /// The configuration is wrong (store URL, credentials, option): fix it;
    /// nothing will work until then.
    Config,
    /// Local I/O failed (disk full, permissions, a directory vanished).
    Io,
}

impl ErrorKind {
    /// The HTTP status a daemon answers with for this kind of failure.
    pub fn http_status(self) -> u16 {
        match self {
            ErrorKind::NotFound => 404,
            ErrorKind::Precondition => 409,
            ErrorKind::BadRequest => 422,
            // The bucket holds something bad: the daemon's upstream failed.
            ErrorKind::Corrupt => 502,
            ErrorKind::Unavailable => 503,
            ErrorKind::Config | ErrorKind::Io => 500,
        }
    }

    /// The process exit code for this kind (sysexits.h values, so scripts can
    /// tell "retry" from "fix the command").
    pub fn exit_code(self) -> i32 {
        match self {
            ErrorKind::BadRequest => 65,   // EX_DATAERR
            ErrorKind::NotFound => 66,     // EX_NOINPUT
            ErrorKind::Unavailable => 69,  // EX_UNAVAILABLE
            ErrorKind::Io => 74,           // EX_IOERR
            ErrorKind::Precondition => 75, // EX_TEMPFAIL
            ErrorKind::Corrupt => 76,      // EX_PROTOCOL
            ErrorKind::Config => 78,       // EX_CONFIG
        }
    }

    /// Whether retrying the same operation later can succeed.
    pub fn is_retryable(self) -> bool {
        matches!(self, ErrorKind::Unavailable | ErrorKind::Precondition)
    }

    /// A stable lowercase name (metrics labels, JSON).
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::NotFound => "not_found",
            ErrorKind::Precondition => "precondition",
            ErrorKind::Corrupt => "corrupt",
            ErrorKind::BadRequest => "bad_request",
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::Config => "config",
            ErrorKind::Io => "io",
        }
    }
}

impl std::fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Errors of the weightcast library.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum Error {
    /// The safetensors container itself is malformed (header, offsets, coverage).
    #[error("malformed safetensors container: {0}")]
    Container(String),

    /// The container parsed, but the weightcast metadata is missing or wrong.
    #[error("bad metadata field `{field}`: {reason}")]
    Metadata {
        /// The metadata key (or `tensors.<name>.<field>`) at fault.
        field: String,
        /// What is wrong with it.
        reason: String,
    },

    /// A tensor's payload or description is inconsistent.
    #[error("tensor `{tensor}`: {reason}")]
    Tensor {
        /// The tensor at fault.
        tensor: String,
        /// What is wrong with it.
        reason: String,
    },

    /// A delta was made from a different state than the one it is applied to.
    #[error("wrong base for {scope}: delta expects digest {expected}, local state has {actual}")]
    WrongBase {
        /// `file` or `tensor <name>`.
        scope: String,
        /// The base digest recorded in the delta.
        expected: String,
        /// The digest of the local state.
        actual: String,
    },

    /// A delta does not fit the local state's structure (tensor count, a
    /// tensor's dtype or shape): it was made for a different model or file.
    #[error("wrong base, the delta was made for a different file: {0}")]
    BaseMismatch(String),

    /// After decoding, the result does not have the digest the publisher recorded:
    /// the payload is corrupt or the local bytes at the changed positions drifted.
    #[error("integrity check failed for {scope}: expected {expected}, got {actual}")]
    Integrity {
        /// `file`, `payload`, `object <key>` or `tensor <name>`.
        scope: String,
        /// What the publisher recorded.
        expected: String,
        /// What was computed locally.
        actual: String,
    },

    /// Two tensor sets cannot be diffed (different names, dtypes or shapes):
    /// the publisher must write an anchor instead.
    #[error("structure changed, a delta cannot express it: {0}")]
    StructureChanged(String),

    /// The requested encoding cannot represent this tensor.
    #[error("encoding `{encoding}` cannot represent tensor `{tensor}`: {reason}")]
    Unsupported {
        /// The encoding name.
        encoding: &'static str,
        /// The tensor.
        tensor: String,
        /// Why.
        reason: String,
    },

    /// Configuration is wrong (a store URL, an option, credentials). The
    /// message names the setting and how to fix it.
    #[error("configuration: {0}")]
    Config(String),

    /// The caller's request or input is invalid (a checkpoint, a request
    /// body, an argument). The message names it.
    #[error("{0}")]
    BadRequest(String),

    /// Something named does not exist.
    #[error("not found: {0}")]
    NotFound(String),

    /// A precondition failed: another writer committed the version, a step
    /// is not newer than the last one, an object changed while it was read.
    #[error("{0}")]
    Conflict(String),

    /// The bucket was written in a layout this release does not read.
    #[error("the bucket at `{url}` holds {found}; this release reads {expected}. {hint}")]
    Layout {
        /// The store URL.
        url: String,
        /// The layout found.
        found: String,
        /// The layout expected.
        expected: String,
        /// What to do.
        hint: String,
    },

    /// An object-store operation failed.
    #[error("store {op} `{key}` at `{url}`: {source}{hint}")]
    Store {
        /// The operation.
        op: String,
        /// The object key.
        key: String,
        /// The store URL (credentials never appear in it).
        url: String,
        /// A hint about the likely fix, with a leading separator, or empty.
        hint: String,
        /// What the caller should do, classified from the backend's error
        /// by the store layer (`weightcast::store`) when it made this one.
        kind: ErrorKind,
        /// The backend's error (an `object_store::Error`).
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },

    /// The operation cannot be done now and was not done (the daemon is
    /// shutting down, a bounded wait ran out); retrying later can succeed.
    /// The message says what was not done.
    #[error("unavailable: {0}")]
    Unavailable(String),

    /// A bucket object is larger than the reader accepts for it.
    #[error("object `{key}` is {size} bytes, more than the {max} accepted for it")]
    TooLarge {
        /// The object key.
        key: String,
        /// Its size.
        size: u64,
        /// The limit.
        max: u64,
    },

    /// An I/O error with the path it happened on.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    /// What the caller should do about this error.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::Container(_)
            | Error::Metadata { .. }
            | Error::Tensor { .. }
            | Error::WrongBase { .. }
            | Error::BaseMismatch(_)
            | Error::Integrity { .. }
            | Error::TooLarge { .. } => ErrorKind::Corrupt,
            Error::StructureChanged(_) | Error::Unsupported { .. } | Error::BadRequest(_) => {
                ErrorKind::BadRequest
            }
            Error::Config(_) | Error::Layout { .. } => ErrorKind::Config,
            Error::NotFound(_) => ErrorKind::NotFound,
            Error::Conflict(_) => ErrorKind::Precondition,
            Error::Store { kind, .. } => *kind,
            Error::Unavailable(_) => ErrorKind::Unavailable,
            Error::Io { source, .. } => match source.kind() {
                std::io::ErrorKind::NotFound => ErrorKind::NotFound,
                _ => ErrorKind::Io,
            },
        }
    }

    /// Whether this is a verification failure of a delta against local state
    /// (wrong base, drift, corrupt payload): the state must be repaired from an
    /// anchor rather than the operation retried.
    pub fn needs_repair(&self) -> bool {
        matches!(
            self,
            Error::WrongBase { .. } | Error::BaseMismatch(_) | Error::Integrity { .. }
        )
    }

    /// Turns an error about input the caller handed in (a checkpoint file, a
    /// request) into [`Error::BadRequest`] naming `what`; other kinds (I/O,
    /// store) pass through unchanged.
    pub fn in_input(self, what: impl std::fmt::Display) -> Error {
        match self.kind() {
            ErrorKind::Corrupt => Error::BadRequest(format!("{what}: {self}")),
            _ => self,
        }
    }

    /// [`Error::Tensor`]: `tensor` is inconsistent, for `reason`.
    pub fn tensor(tensor: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::Tensor {
            tensor: tensor.into(),
            reason: reason.into(),
        }
    }

    /// [`Error::Metadata`]: the metadata `field` is missing or wrong, for `reason`.
    pub fn metadata(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::Metadata {
            field: field.into(),
            reason: reason.into(),
        }
    }

    /// [`Error::Io`]: `source` happened while doing `context`.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_map_to_distinct_actions() {
        let cases = [
            (Error::NotFound("x".into()), ErrorKind::NotFound, 404, 66),
            (
                Error::Conflict("x".into()),
                ErrorKind::Precondition,
                409,
                75,
            ),
            (Error::Container("x".into()), ErrorKind::Corrupt, 502, 76),
            (
                Error::BadRequest("x".into()),
                ErrorKind::BadRequest,
                422,
                65,
            ),
            (Error::Config("x".into()), ErrorKind::Config, 500, 78),
            (
                Error::io("x", std::io::Error::other("disk full")),
                ErrorKind::Io,
                500,
                74,
            ),
        ];
        for (e, kind, http, exit) in cases {
            assert_eq!(e.kind(), kind, "{e}");
            assert_eq!(kind.http_status(), http);
            assert_eq!(kind.exit_code(), exit);
        }
        // Input the caller handed in is a bad request, not bucket corruption.
        let e = Error::Container("bad header".into()).in_input("ckpt/model.safetensors");
        assert_eq!(e.kind(), ErrorKind::BadRequest);
        assert!(e.to_string().contains("ckpt/model.safetensors"), "{e}");
        // Transient I/O passes through.
        let e = Error::io("x", std::io::Error::other("eio")).in_input("f");
        assert_eq!(e.kind(), ErrorKind::Io);
    }
}
