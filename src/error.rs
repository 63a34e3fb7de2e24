//! The library's typed error. Every failure names what was wrong and where
//! (which object, tensor, field), because the input is usually untrusted bytes
//! from a bucket and an operator has to act on the message.

use thiserror::Error;

/// Result alias used across the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

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
    #[error("integrity check failed for {scope}: expected digest {expected}, got {actual}")]
    Integrity {
        /// `file`, `payload` or `tensor <name>`.
        scope: String,
        /// The digest recorded by the publisher.
        expected: String,
        /// The digest computed locally.
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

    /// Configuration is wrong (a store URL, an option).
    #[error("configuration: {0}")]
    Config(String),

    /// An object-store operation failed.
    #[cfg(feature = "store")]
    #[error("store {op} `{key}`: {source}")]
    Store {
        /// The operation.
        op: String,
        /// The object key.
        key: String,
        /// The backend's error.
        #[source]
        source: Box<object_store::Error>,
    },

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
    pub(crate) fn tensor(tensor: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::Tensor {
            tensor: tensor.into(),
            reason: reason.into(),
        }
    }

    pub(crate) fn metadata(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::Metadata {
            field: field.into(),
            reason: reason.into(),
        }
    }

    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }
}
