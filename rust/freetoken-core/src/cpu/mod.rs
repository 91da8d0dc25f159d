//! CPU expert kernels (placeholder).
