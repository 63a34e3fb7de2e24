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

fn main() {
    let cli = cli::Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("weightcast=info"));
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match cli.log_format {
        cli::LogFormat::Text => logs.init(),
        cli::LogFormat::Json => logs.json().init(),
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
