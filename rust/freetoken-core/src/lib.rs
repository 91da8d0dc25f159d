//! freetoken-core: what runs on every decode step on the host side.
//!
//! Pure Rust (no PyO3, no CUDA), so `cargo test` and `cargo bench` run alone.
#![deny(missing_docs)]

/// The crate version, as Cargo sets it.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
