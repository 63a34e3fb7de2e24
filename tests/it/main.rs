//! The integration tests: one binary (as delta-rs lays out its `tests/it`), so
//! the crate is linked once and each real server (moto, Garage,
//! fake-gcs-server) starts once for the whole run. Each module is one area;
//! `cargo test --test it <module>::` runs one of them.

mod common;

mod cli_signals;
mod conformance;
mod deploy_files;
mod distributed;
mod docs_flags;
mod faultproxy;
mod first_hour;
mod fleet;
mod gc;
mod gcs;
mod hooks;
mod hostile;
mod hostile_files;
mod layering;
mod malformed;
mod metrics;
mod notify;
mod oneshot;
mod protocol;
mod publisher;
mod publisher_crash;
mod publisher_daemon;
mod races;
mod real_model;
mod relay;
mod resources;
mod roundtrip;
mod sinks;
mod store;
mod subscriber;
mod subscriber_crash;
mod subscriber_reuse;
mod trl;
mod walkthrough;
