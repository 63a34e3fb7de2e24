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

    /// Every kind, in the order of [`EXIT_CODES`].
    pub const ALL: [ErrorKind; 7] = [
        ErrorKind::BadRequest,
        ErrorKind::NotFound,
        ErrorKind::Unavailable,
        ErrorKind::Io,
        ErrorKind::Precondition,
        ErrorKind::Corrupt,
        ErrorKind::Config,
    ];

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

/// Exit code of a command line that does not parse, or of a flag value the
/// command refuses (sysexits.h `EX_USAGE`).
pub const EXIT_USAGE: i32 = 64;

/// Exit code of a failure no [`ErrorKind`] describes (sysexits.h
/// `EX_SOFTWARE`): a bug.
pub const EXIT_SOFTWARE: i32 = 70;

/// Every exit code of the `weightcast` command, the same for every command:
/// (code, sysexits.h name, when). `README.md` and `weightcast --help` print
/// this table; the library's [`ErrorKind::exit_code`] gives the codes from 65
/// up.
pub const EXIT_CODES: [(i32, &str, &str); 10] = [
    (0, "", "success"),
    (
        EXIT_USAGE,
        "EX_USAGE",
        "a flag or argument is wrong (unknown, missing, or a value the command refuses): fix the command line",
    ),
    (
        65,
        "EX_DATAERR",
        "the input handed in is invalid (a checkpoint that is not safetensors, a request body): fix it",
    ),
    (
        66,
        "EX_NOINPUT",
        "something named does not exist (a local file or directory, a version): check the name",
    ),
    (
        69,
        "EX_UNAVAILABLE",
        "the store or a peer (an engine's hook endpoint) is unreachable or failing: retry later",
    ),
    (
        EXIT_SOFTWARE,
        "EX_SOFTWARE",
        "an internal error (a bug): report it",
    ),
    (74, "EX_IOERR", "local I/O failed (disk full, permissions)"),
    (
        75,
        "EX_TEMPFAIL",
        "a precondition failed (another writer, a step not newer, ranks that did not meet): resync and retry",
    ),
    (
        76,
        "EX_PROTOCOL",
        "data from the bucket is corrupt or fails verification: repair or republish it",
    ),
    (
        78,
        "EX_CONFIG",
        "the configuration is wrong (store URL, credentials, a missing bucket, an option): fix it",
    ),
];

/// [`EXIT_CODES`] as a text table (what `weightcast --help` ends with).
pub fn exit_code_table() -> String {
    let mut out = String::from("Exit codes (the same for every command; sysexits.h):\n");
    for (code, name, when) in EXIT_CODES {
        out.push_str(&format!("  {code:>3}  {name:<15} {when}\n"));
    }
    out
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

    /// A `compact2` delta was made against a context (the changes of the
    /// delta before it, docs/format.md §6.3) that the reader does not hold:
    /// none, or the changes of another version or state.
    #[error("wrong context: the delta needs {expected}; the reader holds {actual}")]
    WrongContext {
        /// The context the delta records.
        expected: String,
        /// The one given (or `none`).
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

    /// An object-store operation failed. Its message carries the backend's
    /// cause chain once (each cause that does not repeat the one before it;
    /// an XML error body reduced to its code and message), then the hint.
    #[error("store {op} `{key}` at `{url}`: {}{hint}", chain_text(source.as_ref()))]
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

/// Longest text a cause from outside weightcast (a backend, the OS)
/// contributes to a one-line error message.
const MAX_CAUSE_CHARS: usize = 400;

/// Reduces an XML error body (S3, GCS, Azure answer with one) to its code
/// and message, quoted once: `NoSuchBucket: "The specified bucket does not
/// exist"`. Text without one is returned as is.
pub fn shorten_xml(text: &str) -> String {
    let Some(start) = text.find("<?xml").or_else(|| text.find("<Error>")) else {
        return text.to_string();
    };
    let tag = |name: &str| {
        let open = format!("<{name}>");
        let close = format!("</{name}>");
        let from = text[start..].find(&open)? + start + open.len();
        let to = text[from..].find(&close)? + from;
        Some(text[from..to].trim().to_string())
    };
    let summary = match (tag("Code"), tag("Message")) {
        (Some(c), Some(m)) => format!("{c}: \"{m}\""),
        (Some(c), None) => c,
        (None, Some(m)) => format!("\"{m}\""),
        (None, None) => "an XML error body".to_string(),
    };
    let before = text[..start].trim_end();
    if before.is_empty() {
        summary
    } else {
        format!("{before} {summary}")
    }
}

/// Cuts `text` to [`MAX_CAUSE_CHARS`] characters (on a character boundary).
fn bounded(text: String) -> String {
    match text.char_indices().nth(MAX_CAUSE_CHARS) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text,
    }
}

/// An error and its causes on one line, each cause once: a cause whose text
/// the line already holds (an error that prints its source, as most do) adds
/// nothing, XML bodies are reduced to their code and message
/// ([`shorten_xml`]), and each cause from outside weightcast is bounded in
/// length. What the CLI
/// prints, and what a daemon reports as its last error.
pub fn one_line(e: &(dyn std::error::Error + 'static)) -> String {
    let mut line = String::new();
    let mut cause = Some(e);
    while let Some(c) = cause {
        // weightcast's own messages are written whole (what failed, where,
        // the fix); a backend's text is bounded.
        let text = shorten_xml(c.to_string().trim());
        let text = if c.is::<Error>() { text } else { bounded(text) };
        if !text.is_empty() && !line.contains(&text) {
            if !line.is_empty() {
                line.push_str(": ");
            }
            line.push_str(&text);
        }
        cause = c.source();
    }
    line.replace(['\n', '\r'], " ")
}

/// The cause chain of a backend error, once ([`one_line`]).
fn chain_text(e: &(dyn std::error::Error + Send + Sync + 'static)) -> String {
    one_line(e)
}

impl Error {
    /// What the caller should do about this error.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::Container(_)
            | Error::Metadata { .. }
            | Error::Tensor { .. }
            | Error::WrongBase { .. }
            | Error::WrongContext { .. }
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
            Error::WrongBase { .. }
                | Error::WrongContext { .. }
                | Error::BaseMismatch(_)
                | Error::Integrity { .. }
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

    #[derive(Debug)]
    struct Layer(String, Option<Box<Layer>>);
    impl std::fmt::Display for Layer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(&self.0)
        }
    }
    impl std::error::Error for Layer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.1
                .as_deref()
                .map(|l| l as &(dyn std::error::Error + 'static))
        }
    }

    #[test]
    fn a_cause_chain_is_one_line_with_each_cause_once_and_xml_reduced() {
        let xml = "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>NoSuchBucket</Code>\
                   <Message>The specified bucket does not exist</Message><BucketName>wieghts\
                   </BucketName><RequestId>123</RequestId></Error>";
        let inner = Layer(format!("404 Not Found: {xml}"), None);
        let middle = Layer(
            format!("Error performing list in 3ms - 404 Not Found: {xml}"),
            Some(Box::new(inner)),
        );
        let outer = Layer(
            format!("Generic S3 error: Error performing list in 3ms - 404 Not Found: {xml}"),
            Some(Box::new(middle)),
        );
        let line = one_line(&outer);
        assert_eq!(line.matches("NoSuchBucket").count(), 1, "{line}");
        assert_eq!(line.matches("does not exist").count(), 1, "{line}");
        assert!(!line.contains("<?xml") && !line.contains('\n'), "{line}");
        assert!(line.len() < 200, "{line}");
        // A cause that adds something is kept, after what it explains.
        let e = Layer(
            "error sending request".into(),
            Some(Box::new(Layer(
                "Connection refused (os error 111)".into(),
                None,
            ))),
        );
        assert_eq!(
            one_line(&e),
            "error sending request: Connection refused (os error 111)"
        );
        // A store error prints its backend's chain once, then the hint.
        let e = Error::Store {
            op: "list".into(),
            key: "versions/".into(),
            url: "s3://wieghts/policy".into(),
            hint: " (the bucket does not exist: create it)".into(),
            kind: ErrorKind::Config,
            source: Box::new(outer),
        };
        let text = one_line(&e);
        assert_eq!(text.matches("NoSuchBucket").count(), 1, "{text}");
        assert!(
            text.ends_with("(the bucket does not exist: create it)"),
            "{text}"
        );
    }

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
        // Every kind's code is in the one table, and the table's codes are
        // distinct.
        for k in ErrorKind::ALL {
            assert!(
                EXIT_CODES.iter().any(|(c, _, _)| *c == k.exit_code()),
                "{k}"
            );
        }
        let mut codes: Vec<i32> = EXIT_CODES.iter().map(|c| c.0).collect();
        codes.dedup();
        assert_eq!(codes.len(), EXIT_CODES.len());
        // Transient I/O passes through.
        let e = Error::io("x", std::io::Error::other("eio")).in_input("f");
        assert_eq!(e.kind(), ErrorKind::Io);
    }
}
