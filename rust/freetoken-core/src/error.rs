//! Error types, one `thiserror` enum per subsystem, with structured fields.
//!
//! Each enum reports an [`ErrorKind`] so the bindings can pick the natural Python exception
//! (`IndexError`, `ValueError`, `FileNotFoundError`, ...) without parsing messages.
use std::path::PathBuf;

/// The broad class of an error, used by the bindings to choose a Python exception type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// An index (layer, expert, slot) out of range.
    Index,
    /// A bad argument value or shape.
    Value,
    /// A file that should exist does not.
    NotFound,
    /// Any other operating-system error (mmap, read, permissions).
    Io,
    /// A checkpoint whose content is wrong (missing tensor, wrong shape or dtype).
    Checkpoint,
    /// The expert cache cannot satisfy the request (every slot pinned).
    Capacity,
    /// A routing-trace file is malformed.
    Trace,
    /// A worker thread failed (a bug; reported rather than crossing as a panic).
    Internal,
    /// The other side of a handshake did not answer in time (a device that never posted).
    Timeout,
}

/// Errors of the host expert pool ([`crate::pool`]).
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// `layer` is not a pool layer index (`0..num_layers`).
    #[error("pool layer {layer} out of range: the pool has {num_layers} MoE layers (index into moe_layers)")]
    LayerIndex {
        /// The bad index.
        layer: i64,
        /// Number of MoE layers in the pool.
        num_layers: usize,
    },
    /// `expert` is not in `0..num_experts`.
    #[error("expert {expert} out of range: each layer has {num_experts} experts")]
    ExpertIndex {
        /// The bad index.
        expert: i64,
        /// Number of routed experts per layer.
        num_experts: usize,
    },
    /// A model layer index that is not a MoE layer of this pool.
    #[error(
        "model layer {model_layer} is not a MoE layer of this pool (MoE layers: {moe_layers:?})"
    )]
    NotMoeLayer {
        /// The model layer asked for.
        model_layer: i64,
        /// The model layers that are MoE layers.
        moe_layers: Vec<usize>,
    },
    /// A shape or configuration value is invalid.
    #[error("invalid pool configuration: {0}")]
    Config(String),
    /// A file that the checkpoint needs is missing.
    #[error("{}: file not found ({what})", path.display())]
    FileNotFound {
        /// The missing file.
        path: PathBuf,
        /// What needed it.
        what: String,
    },
    /// Reading or mapping a file failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// Anonymous memory for the arena could not be mapped.
    #[error("could not map {nbytes} bytes of host memory for the expert arena: {source}")]
    Alloc {
        /// Bytes asked for.
        nbytes: usize,
        /// The OS error.
        source: std::io::Error,
    },
    /// `config.json` or the shard index is malformed.
    #[error("{}: {msg}", path.display())]
    BadConfig {
        /// The JSON file.
        path: PathBuf,
        /// What is wrong.
        msg: String,
    },
    /// A tensor the pool needs is absent from every shard.
    #[error("{}: tensor {tensor} is missing ({what})", path.display())]
    MissingTensor {
        /// The file where it was expected (index or shard).
        path: PathBuf,
        /// The tensor name.
        tensor: String,
        /// Which expert part was not found.
        what: String,
    },
    /// A tensor has the wrong shape.
    #[error("{}: tensor {tensor} has shape {got:?}, expected {expected}", path.display())]
    BadShape {
        /// The shard file.
        path: PathBuf,
        /// The tensor name.
        tensor: String,
        /// The shape found.
        got: Vec<usize>,
        /// The shape(s) accepted.
        expected: String,
    },
    /// A tensor has a dtype the pool cannot pack.
    #[error("{}: tensor {tensor} has dtype {got}, expected BF16, F16 or F32", path.display())]
    BadDtype {
        /// The shard file.
        path: PathBuf,
        /// The tensor name.
        tensor: String,
        /// The dtype found.
        got: String,
    },
    /// The safetensors header could not be parsed.
    #[error("{}: not a valid safetensors file: {msg}", path.display())]
    BadSafetensors {
        /// The shard file.
        path: PathBuf,
        /// The parser's message.
        msg: String,
    },
    /// A loader thread panicked.
    #[error("loader thread failed: {0}")]
    Internal(String),
}

impl PoolError {
    /// The broad class of this error.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::LayerIndex { .. } | Self::ExpertIndex { .. } | Self::NotMoeLayer { .. } => {
                ErrorKind::Index
            }
            Self::Config(_) => ErrorKind::Value,
            Self::FileNotFound { .. } => ErrorKind::NotFound,
            Self::Io { .. } | Self::Alloc { .. } => ErrorKind::Io,
            Self::BadConfig { .. }
            | Self::MissingTensor { .. }
            | Self::BadShape { .. }
            | Self::BadDtype { .. }
            | Self::BadSafetensors { .. } => ErrorKind::Checkpoint,
            Self::Internal(_) => ErrorKind::Internal,
        }
    }
}

/// Errors of the slot map and its policies ([`crate::cache`]).
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// `(layer, expert)` outside the key space the map was built for.
    #[error("key (layer {layer}, expert {expert}) out of range: the map covers {num_layers} layers x {num_experts} experts")]
    KeyOutOfRange {
        /// Pool layer.
        layer: i64,
        /// Expert id.
        expert: i64,
        /// Layers covered.
        num_layers: usize,
        /// Experts per layer.
        num_experts: usize,
    },
    /// Every slot is pinned by the step in flight, so nothing can be evicted.
    #[error("all {capacity} expert_cache slots are pinned by the step in flight; raise the expert_cache capacity above the distinct experts of one layer step")]
    AllPinned {
        /// The capacity.
        capacity: usize,
    },
    /// An unknown policy name.
    #[error(
        "unknown expert_cache policy {0:?}; known: lru, layer_lru, lfu, min (min needs a trace)"
    )]
    UnknownPolicy(String),
    /// A bad argument.
    #[error("{0}")]
    Invalid(String),
}

impl CacheError {
    /// The broad class of this error.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::KeyOutOfRange { .. } => ErrorKind::Index,
            Self::AllPinned { .. } => ErrorKind::Capacity,
            Self::UnknownPolicy(_) | Self::Invalid(_) => ErrorKind::Value,
        }
    }
}

/// Errors of the q* planner ([`crate::planner`]).
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// A bad argument (shape, backend name, bandwidth).
    #[error("{0}")]
    Invalid(String),
    /// An expert id or layer out of range.
    #[error("{0}")]
    Index(String),
    /// The slot map refused.
    #[error(transparent)]
    Cache(#[from] CacheError),
}

impl PlanError {
    /// The broad class of this error.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::Invalid(_) => ErrorKind::Value,
            Self::Index(_) => ErrorKind::Index,
            Self::Cache(e) => e.kind(),
        }
    }
}

/// Errors of the CPU expert kernels ([`crate::cpu`]).
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// A bad argument (shape, length).
    #[error("{0}")]
    Invalid(String),
    /// An expert id or layer out of range.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// A worker thread panicked while running a task.
    #[error("CPU expert worker failed: {0}")]
    Worker(String),
}

impl KernelError {
    /// The broad class of this error.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::Invalid(_) => ErrorKind::Value,
            Self::Pool(e) => e.kind(),
            Self::Worker(_) => ErrorKind::Internal,
        }
    }
}

/// Errors of routing traces ([`crate::trace`]).
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// Reading or writing the file failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The trace file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The file is not a trace or is truncated.
    #[error("{}: {msg}", path.display())]
    Format {
        /// The trace file.
        path: PathBuf,
        /// What is wrong.
        msg: String,
    },
    /// A record does not fit the trace's header (ids out of range, wrong width).
    #[error("{0}")]
    Invalid(String),
}

impl TraceError {
    /// The broad class of this error.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
                ErrorKind::NotFound
            }
            Self::Io { .. } => ErrorKind::Io,
            Self::Format { .. } => ErrorKind::Trace,
            Self::Invalid(_) => ErrorKind::Value,
        }
    }
}

/// Errors of the decode driver ([`crate::driver`]).
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    /// A bad argument (buffer sizes, batch, mode).
    #[error("{0}")]
    Invalid(String),
    /// The device did not post a layer's routing in time.
    #[error(
        "decode step {step}: the device did not post MoE layer {layer}'s routing within {waited:?}"
    )]
    DeviceTimeout {
        /// Generation of the step.
        step: u32,
        /// Pool layer that was never posted.
        layer: usize,
        /// How long the driver waited.
        waited: std::time::Duration,
    },
    /// The driver did not serve a layer in time (`DecodeDriver::wait_served`).
    #[error("decode step {step}: MoE layer {layer} was not served within {waited:?}")]
    NotServed {
        /// Generation of the step.
        step: u32,
        /// Pool layer waited for.
        layer: usize,
        /// How long the caller waited.
        waited: std::time::Duration,
    },
    /// The copy stream's fills did not land in time (a wedged copy engine).
    #[error("{0}")]
    Timeout(String),
    /// A CUDA driver call failed, or the CUDA driver library could not be loaded.
    #[error("{0}")]
    Cuda(String),
    /// Planning a layer step failed.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// The CPU experts failed.
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// The caller's work at a point of the layer step failed (a Python callback).
    #[error("{0}")]
    Hook(String),
    /// An error while serving one MoE layer of a driven step.
    #[error("MoE layer {layer}: {source}")]
    Layer {
        /// Pool layer.
        layer: usize,
        /// What went wrong there.
        source: Box<DriverError>,
    },
}

impl DriverError {
    /// `source`, marked as raised while serving pool layer `layer`.
    pub fn at_layer(layer: usize, source: DriverError) -> Self {
        Self::Layer {
            layer,
            source: Box::new(source),
        }
    }

    /// The step and layer of a timeout on the handshake, if this is one.
    pub fn timed_out_at(&self) -> Option<(u32, usize)> {
        match self {
            Self::DeviceTimeout { step, layer, .. } | Self::NotServed { step, layer, .. } => {
                Some((*step, *layer))
            }
            Self::Layer { source, .. } => source.timed_out_at(),
            _ => None,
        }
    }
}

impl DriverError {
    /// The broad class of this error.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::Invalid(_) => ErrorKind::Value,
            Self::DeviceTimeout { .. } | Self::NotServed { .. } | Self::Timeout(_) => {
                ErrorKind::Timeout
            }
            Self::Cuda(_) | Self::Hook(_) => ErrorKind::Internal,
            Self::Plan(e) => e.kind(),
            Self::Kernel(e) => e.kind(),
            Self::Layer { source, .. } => source.kind(),
        }
    }
}
