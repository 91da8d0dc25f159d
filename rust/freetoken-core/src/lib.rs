//! freetoken-core: what runs on every decode step on the host side.
//!
//! Pure Rust (no PyO3; CUDA only through the driver library loaded at run time by
//! [`driver::cuda`]), so `cargo test` and `cargo bench` run alone.
//!
//! ```text
//! router top-k ids [B,k] ──> planner (q*) ──> hits: slot ids        ──> GPU grouped kernel
//!                              │   ▲          fills: expert -> slot ──> H2D copy from the pool arena
//!                              │   │          cpu: expert ids       ──> cpu::CpuExperts (worker pool)
//!                              ▼   │
//!                           cache::SlotMap + Policy (LRU, layer_lru, lfu, MIN)
//! ```
//! Glossary: *pool* = host RAM holding every routed expert ([`pool`]); *slot* = one GPU expert
//! buffer ([`cache`]); *layer* in this crate = pool layer, an index into the pool's MoE layers.
#![deny(missing_docs)]

pub mod align;
pub mod bf16;
pub mod cache;
pub mod cpu;
pub mod driver;
pub mod error;
pub mod numa;
pub mod planner;
pub mod pool;
pub mod quant;
pub mod trace;

/// The crate version, as Cargo sets it.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
