//! The `weightcast` command line: a thin layer over the library.
//!
//! `cli` defines the commands and flags (clap); `commands` is one small
//! function per command over the library's API. One tokio runtime serves
//! every command; library errors become exit codes by their kind
//! (`weightcast::error::ErrorKind::exit_code`) here and nowhere else.

mod cli;
mod commands;

use clap::Parser;
use peak_alloc::PeakAlloc;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// The allocator, counted, so `bench` can report peak heap use.
#[global_allocator]
static ALLOC: PeakAlloc = PeakAlloc;

/// The exit code for a failure: the library's error kind decides, 1 for
/// anything else (bad flags, the binary's own checks).
fn exit_code(e: &anyhow::Error) -> i32 {
    e.chain()
        .find_map(|c| c.downcast_ref::<weightcast::Error>())
        .map_or(1, |w| w.kind().exit_code())
}

/// Open files the process needs at the least: the runtime's own, the
/// store's connections, concurrent ranged downloads, output files.
const MIN_OPEN_FILES: u64 = 64;
/// The soft open-file limit is raised towards this (within the hard limit).
const WANT_OPEN_FILES: u64 = 4096;

/// Raises the soft open-file limit towards [`WANT_OPEN_FILES`] (as far as the
/// hard limit allows) and refuses to start below [`MIN_OPEN_FILES`]: with too
/// few descriptors the async runtime itself cannot start (tokio panics), and
/// downloads would fail half-way with EMFILE.
fn ensure_open_files() -> Result<(), String> {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    let mut current = limit.current.unwrap_or(u64::MAX);
    let maximum = limit.maximum.unwrap_or(u64::MAX);
    if current < WANT_OPEN_FILES && maximum > current {
        let want = WANT_OPEN_FILES.min(maximum);
        let raised = Rlimit {
            current: Some(want),
            maximum: limit.maximum,
        };
        if setrlimit(Resource::Nofile, raised).is_ok() {
            current = want;
        }
    }
    if current < MIN_OPEN_FILES {
        return Err(format!(
            "the open-file limit (ulimit -n) is {current}; weightcast needs at least \
             {MIN_OPEN_FILES}: raise it (`ulimit -n {WANT_OPEN_FILES}`, or LimitNOFILE= in a \
             systemd unit, or the container runtime's nofile ulimit)"
        ));
    }
    Ok(())
}

/// The log filter: `RUST_LOG`'s `target=level` directives (e.g.
/// `weightcast=debug,info`), `weightcast=info` when unset. A filter that does
/// not parse is refused, naming the variable.
fn log_filter() -> anyhow::Result<tracing_subscriber::filter::Targets> {
    let spec = std::env::var("RUST_LOG").unwrap_or_default();
    let spec = if spec.trim().is_empty() {
        "weightcast=info"
    } else {
        &spec
    };
    spec.parse().map_err(|e| {
        anyhow::anyhow!(
            "RUST_LOG={spec:?} is not a log filter ({e}): use comma-separated `target=level` \
             directives or a bare level, e.g. RUST_LOG=weightcast=debug,info"
        )
    })
}

fn main() {
    let cli = cli::Cli::parse();
    if let Err(e) = ensure_open_files() {
        eprintln!("Error: {e}");
        std::process::exit(weightcast::error::ErrorKind::Config.exit_code());
    }
    let filter = match log_filter() {
        Ok(f) => f,
        Err(e) => {
            eprintln!("Error: {e}");
            std::process::exit(weightcast::error::ErrorKind::Config.exit_code());
        }
    };
    // Colours only on a terminal (not in files, journald or log pipelines).
    let logs = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    match cli.log_format {
        cli::LogFormat::Text => logs.finish().with(filter).init(),
        cli::LogFormat::Json => logs.json().finish().with(filter).init(),
    }
    let result = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(anyhow::Error::from)
        .and_then(|rt| rt.block_on(commands::run(cli.command)));
    if let Err(e) = result {
        eprintln!("Error: {e:#}");
        std::process::exit(exit_code(&e));
    }
}
