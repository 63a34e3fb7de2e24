//! The `weightcast` command line: a thin layer over the library.
//!
//! `cli` defines the commands and flags (clap); `commands` is one small
//! function per command over the library's API. One tokio runtime serves
//! every command; library errors become exit codes by their kind
//! (`weightcast::error::ErrorKind::exit_code`) here and nowhere else.

mod cli;
mod commands;

use clap::{CommandFactory, FromArgMatches};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use weightcast::error::{EXIT_SOFTWARE, EXIT_USAGE};

/// The exit code for a failure, from the one table
/// (`weightcast::error::EXIT_CODES`): the library's error kind decides, 64
/// for a command line the command refuses, 70 for anything else.
fn exit_code(e: &anyhow::Error) -> i32 {
    for c in e.chain() {
        if let Some(w) = c.downcast_ref::<weightcast::Error>() {
            return w.kind().exit_code();
        }
        if c.is::<cli::Usage>() {
            return EXIT_USAGE;
        }
    }
    EXIT_SOFTWARE
}

/// The command line's definition, with the exit-code table after every
/// command's help.
fn command() -> clap::Command {
    let table = weightcast::error::exit_code_table();
    cli::Cli::command()
        .after_help(table.clone())
        .mut_subcommands(|c| c.after_help(table.clone()))
}

/// Parses the command line: help and version exit 0; anything the parser
/// (or [`cli::validate`]) refuses exits 64 (`EX_USAGE`) with clap's message.
fn parse() -> cli::Cli {
    let parsed = command()
        .try_get_matches()
        .and_then(|m| cli::Cli::from_arg_matches(&m))
        .and_then(|c| cli::validate(&c).map(|()| c));
    match parsed {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() { EXIT_USAGE } else { 0 };
            let _ = e.print();
            std::process::exit(code);
        }
    }
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

/// The log filter when `RUST_LOG` is unset: weightcast's events, and the
/// store client's retries (object_store logs each retry as one line at
/// info: a store that does not answer is never silent).
const DEFAULT_LOG_FILTER: &str = "weightcast=info,object_store=info";

/// The log filter: `RUST_LOG`'s `target=level` directives (e.g.
/// `weightcast=debug,info`), [`DEFAULT_LOG_FILTER`] when unset. A filter that does
/// not parse is refused, naming the variable.
fn log_filter() -> anyhow::Result<tracing_subscriber::filter::Targets> {
    let spec = std::env::var("RUST_LOG").unwrap_or_default();
    let spec = if spec.trim().is_empty() {
        DEFAULT_LOG_FILTER
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

/// Allocations from this size up get their own memory map, returned to the
/// system when freed (glibc's `M_MMAP_THRESHOLD`; also the `M_TRIM_THRESHOLD`
/// for the heap's top).
const ALLOCATOR_RELEASE_FROM: i32 = 1 << 20;

/// Keeps the process's anonymous memory near what is live. glibc's default
/// mmap threshold rises to the largest block freed (up to 32 MiB), after which
/// the large, short-lived buffers of a publish (deltas, upload parts, encode
/// blocks) come from per-thread arenas that keep them once freed: the
/// `publisher` daemon's peak RssAnon grew with the model (351 MiB for an
/// anchor of a 2 GB model, 462 MiB at 6 GB) although its live heap stayed
/// near 50 MiB. With a fixed 1 MiB threshold the same anchor peaked at
/// 148 MiB and a delta at 27 MiB (against 227), at the same speed
/// (`docs/benchmarks.md`, "End to end at scale"). Returns whether the
/// allocator took the settings (false off glibc).
fn release_freed_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only changes two tuning parameters of glibc's
        // allocator; glibc documents it as MT-Safe and callable at any time,
        // and both values are valid for these parameters (positive, below
        // the 32 MiB maximum of the mmap threshold on 64-bit). No memory is
        // touched through the call.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, ALLOCATOR_RELEASE_FROM) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, ALLOCATOR_RELEASE_FROM) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

/// How long the runtime waits for its blocking tasks once a command is done.
const RUNTIME_SHUTDOWN: std::time::Duration = std::time::Duration::from_secs(2);

fn main() {
    release_freed_memory();
    let cli = parse();
    commands::PRETTY.store(cli.pretty, std::sync::atomic::Ordering::Relaxed);
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
    // The fmt subscriber's own level cap (INFO by default) is lifted: the
    // `RUST_LOG` targets filter alone decides (`weightcast=debug` shows the
    // debug events).
    let logs = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
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
        .and_then(|rt| {
            let result = rt.block_on(commands::run(cli.command));
            // A blocking task that never returns (a read stuck on a file
            // system) must not keep a stopped daemon alive: it is abandoned.
            rt.shutdown_timeout(RUNTIME_SHUTDOWN);
            result
        });
    if let Err(e) = result {
        // The cause chain once, on one line, ending with the fix.
        eprintln!("Error: {}", weightcast::error::one_line(&*e));
        std::process::exit(exit_code(&e));
    }
}

#[cfg(test)]
mod tests {
    /// RssAnon of this process, KiB.
    fn rss_anon_kib() -> u64 {
        std::fs::read_to_string("/proc/self/status")
            .unwrap()
            .lines()
            .find_map(|l| l.strip_prefix("RssAnon:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap()
    }

    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn the_allocator_takes_the_settings_and_gives_freed_blocks_back() {
        assert!(super::release_freed_memory());
        // Blocks from 1 MiB up are mapped on their own: freeing them returns
        // their pages at once, even after a bigger block was freed (which
        // raises glibc's default threshold above them).
        drop(std::hint::black_box(vec![1u8; 24 << 20]));
        let before = rss_anon_kib();
        // Each block with a small allocation after it that stays live, so
        // that freeing the blocks leaves holes the heap cannot trim.
        let (blocks, pins): (Vec<Vec<u8>>, Vec<Vec<u8>>) = (0..16)
            .map(|i| (vec![i as u8 + 1; 4 << 20], vec![i as u8; 64]))
            .unzip();
        let held = rss_anon_kib();
        drop(std::hint::black_box(blocks));
        std::hint::black_box(&pins);
        let after = rss_anon_kib();
        assert!(held >= before + 48 * 1024, "{before} {held} {after}");
        assert!(after + 48 * 1024 <= held, "{before} {held} {after}");
    }
}
