//! Loads the routed experts of a Hugging Face MoE checkpoint (Qwen3-MoE layout) into the pool.
//!
//! Owns: reading `config.json`, the shard index, and the safetensors shards (mmap), and packing
//! tensors into the arena, converting F32/F16 to bf16 and transposing where the file stores the
//! transposed form. Not: non-expert weights (Python/torch loads those).
//!
//! Tensor names read, for model layer `L` and expert `E`:
//! - per expert: `model.layers.{L}.mlp.experts.{E}.{gate_proj,up_proj,down_proj}.weight`
//!   with shapes `[I, H]`, `[I, H]`, `[H, I]`;
//! - fused (transformers >= 5): `model.layers.{L}.mlp.experts.gate_up_proj` `[E, 2I, H]` (gate rows
//!   first) and `model.layers.{L}.mlp.experts.down_proj` `[E, H, I]`; the transposed forms
//!   `[E, H, 2I]` and `[E, I, H]` are accepted and transposed while packing.
//!
//! MoE layers: `L` such that `mlp_only_layers` does not list it and `(L + 1) % decoder_sparse_step == 0`
//! (Qwen-MoE); with `first_k_dense_replace` in the config (DeepSeek-V2/V3, same tensor names),
//! `L >= first_k_dense_replace` with `L % moe_layer_freq == 0`.
//!
//! Memory: each loader thread maps one shard at a time and drops each tensor's source pages
//! (`MADV_DONTNEED`) once packed, so peak RSS stays near arena + the tensors in flight.
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

use super::{ExpertPool, PoolShape};
use crate::bf16::{f16_to_f32, f32_to_bf16};
use crate::error::PoolError;
use crate::numa;

/// Where a tensor goes in the pool.
#[derive(Debug, Clone, Copy)]
enum Target {
    /// `gate_proj.weight` `[I, H]` of (pool layer, expert): rows `0..I` of gate_up.
    Gate(usize, usize),
    /// `up_proj.weight` `[I, H]`: rows `I..2I` of gate_up.
    Up(usize, usize),
    /// `down_proj.weight` `[H, I]`.
    Down(usize, usize),
    /// Fused `gate_up_proj` `[E, 2I, H]` (or `[E, H, 2I]`) of a pool layer.
    FusedGateUp(usize),
    /// Fused `down_proj` `[E, H, I]` (or `[E, I, H]`) of a pool layer.
    FusedDown(usize),
}

fn read_json(path: &Path) -> Result<Value, PoolError> {
    let text = std::fs::read_to_string(path).map_err(|source| {
        if source.kind() == std::io::ErrorKind::NotFound {
            PoolError::FileNotFound {
                path: path.into(),
                what: "a model directory needs config.json".into(),
            }
        } else {
            PoolError::Io {
                path: path.into(),
                source,
            }
        }
    })?;
    serde_json::from_str(&text).map_err(|e| PoolError::BadConfig {
        path: path.into(),
        msg: format!("invalid JSON: {e}"),
    })
}

/// Reads the pool shape from a Hugging Face `config.json` (uses `text_config` when present).
pub fn shape_from_config(path: &Path) -> Result<PoolShape, PoolError> {
    let root = read_json(path)?;
    let experts_key = |c: &Value| {
        ["num_experts", "num_local_experts", "n_routed_experts"]
            .into_iter()
            .find(|k| c.get(*k).is_some())
    };
    let cfg = root
        .get("text_config")
        .filter(|c| experts_key(c).is_some())
        .unwrap_or(&root);
    let get = |key: &str| -> Result<usize, PoolError> {
        cfg.get(key)
            .and_then(Value::as_u64)
            .map(|v| v as usize)
            .ok_or_else(|| PoolError::BadConfig {
                path: path.into(),
                msg: format!("missing or non-integer field {key:?} (needed for the expert pool)"),
            })
    };
    let num_layers = get("num_hidden_layers")?;
    // transformers >= 5 writes `num_local_experts` for qwen3_moe; older versions `num_experts`.
    let num_experts = get(experts_key(cfg).unwrap_or("num_experts"))?;
    let hidden_size = get("hidden_size")?;
    let intermediate_size = get("moe_intermediate_size")?;
    let step = cfg
        .get("decoder_sparse_step")
        .and_then(Value::as_u64)
        .unwrap_or(1)
        .max(1) as usize;
    let mlp_only: Vec<usize> = cfg
        .get("mlp_only_layers")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Value::as_u64)
                .map(|v| v as usize)
                .collect()
        })
        .unwrap_or_default();
    let int = |key: &str| cfg.get(key).and_then(Value::as_u64).map(|v| v as usize);
    let moe_layers: Vec<usize> = match int("first_k_dense_replace") {
        // DeepSeek-V2/V3 layout: dense layers first, then MoE every `moe_layer_freq` layers.
        Some(k) => {
            let freq = int("moe_layer_freq").unwrap_or(1).max(1);
            (k..num_layers).filter(|l| l % freq == 0).collect()
        }
        None => (0..num_layers)
            .filter(|l| !mlp_only.contains(l) && (l + 1) % step == 0)
            .collect(),
    };
    let shape = PoolShape {
        moe_layers,
        num_experts,
        hidden_size,
        intermediate_size,
        format: crate::quant::ExpertFormat::Bf16,
    };
    shape.validate().map_err(|e| PoolError::BadConfig {
        path: path.into(),
        msg: e.to_string(),
    })?;
    Ok(shape)
}

/// Maps every tensor name to its shard file, from the index or the single `model.safetensors`.
/// Returns the map and the file to blame for a missing tensor.
fn weight_map(dir: &Path) -> Result<(HashMap<String, PathBuf>, PathBuf), PoolError> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let v = read_json(&index)?;
        let map = v
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| PoolError::BadConfig {
                path: index.clone(),
                msg: "no \"weight_map\" object".into(),
            })?;
        let mut out = HashMap::with_capacity(map.len());
        for (name, file) in map {
            let file = file.as_str().ok_or_else(|| PoolError::BadConfig {
                path: index.clone(),
                msg: format!("weight_map[{name:?}] is not a file name"),
            })?;
            out.insert(name.clone(), dir.join(file));
        }
        return Ok((out, index));
    }
    let single = dir.join("model.safetensors");
    if !single.exists() {
        return Err(PoolError::FileNotFound {
            path: single,
            what: "a model directory needs model.safetensors or model.safetensors.index.json"
                .into(),
        });
    }
    let (_, mmap) = map_file(&single)?;
    let (_, meta) = SafeTensors::read_metadata(&mmap).map_err(|e| PoolError::BadSafetensors {
        path: single.clone(),
        msg: e.to_string(),
    })?;
    let out = meta
        .tensors()
        .into_keys()
        .map(|k| (k, single.clone()))
        .collect();
    Ok((out, single))
}

fn map_file(path: &Path) -> Result<(std::fs::File, memmap2::Mmap), PoolError> {
    let file = std::fs::File::open(path).map_err(|source| {
        if source.kind() == std::io::ErrorKind::NotFound {
            PoolError::FileNotFound {
                path: path.into(),
                what: "listed in the shard index".into(),
            }
        } else {
            PoolError::Io {
                path: path.into(),
                source,
            }
        }
    })?;
    // SAFETY: the file is mapped read-only; a concurrent writer truncating a checkpoint under
    // us is outside the contract (as for every safetensors loader).
    let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(|source| PoolError::Io {
        path: path.into(),
        source,
    })?;
    Ok((file, mmap))
}

/// Builds the pool from a Hugging Face model directory with `num_threads` loader threads
/// (default: min(shards, allowed CPUs)).
pub fn load(dir: &Path, num_threads: Option<usize>) -> Result<ExpertPool, PoolError> {
    if !dir.is_dir() {
        return Err(PoolError::FileNotFound {
            path: dir.into(),
            what: "model directory".into(),
        });
    }
    let config = dir.join("config.json");
    let shape = shape_from_config(&config)?;
    // `null` (as some exporters write for an unquantized model) is no quantization
    let quantization = read_json(&config)?.get("quantization_config").cloned();
    if quantization.is_some_and(|q| !q.is_null()) {
        return Err(PoolError::BadConfig {
            path: config,
            msg:
                "a quantized checkpoint: its experts are packed into an ExpertPool.zeroed pool by \
                  freetoken.quant, not read by this bf16 loader"
                    .into(),
        });
    }
    let (map, map_file_path) = weight_map(dir)?;
    // Group the needed tensors by shard.
    let mut by_shard: HashMap<PathBuf, Vec<(String, Target)>> = HashMap::new();
    for (pl, &ml) in shape.moe_layers.iter().enumerate() {
        let fused_gu = format!("model.layers.{ml}.mlp.experts.gate_up_proj");
        let fused_d = format!("model.layers.{ml}.mlp.experts.down_proj");
        let mut need: Vec<(String, Target)> = Vec::new();
        if map.contains_key(&fused_gu) || map.contains_key(&fused_d) {
            need.push((fused_gu, Target::FusedGateUp(pl)));
            need.push((fused_d, Target::FusedDown(pl)));
        } else {
            for e in 0..shape.num_experts {
                let p = format!("model.layers.{ml}.mlp.experts.{e}");
                need.push((format!("{p}.gate_proj.weight"), Target::Gate(pl, e)));
                need.push((format!("{p}.up_proj.weight"), Target::Up(pl, e)));
                need.push((format!("{p}.down_proj.weight"), Target::Down(pl, e)));
            }
        }
        for (name, t) in need {
            let shard = map.get(&name).ok_or_else(|| PoolError::MissingTensor {
                path: map_file_path.clone(),
                tensor: name.clone(),
                what: format!("routed expert weights of model layer {ml} (pool layer {pl})"),
            })?;
            by_shard.entry(shard.clone()).or_default().push((name, t));
        }
    }
    let mut shards: Vec<(PathBuf, Vec<(String, Target)>)> = by_shard.into_iter().collect();
    shards.sort_by(|a, b| a.0.cmp(&b.0));
    for (path, _) in &shards {
        if !path.exists() {
            return Err(PoolError::FileNotFound {
                path: path.clone(),
                what: format!("shard listed in {}", map_file_path.display()),
            });
        }
    }

    let pool = ExpertPool::alloc(shape)?;
    let threads = num_threads
        .unwrap_or_else(|| numa::allowed_cpus().len())
        .clamp(1, shards.len().max(1));
    let nodes = numa::nodes();
    let next = AtomicUsize::new(0);
    let first_err: Mutex<Option<PoolError>> = Mutex::new(None);
    std::thread::scope(|s| {
        for t in 0..threads {
            let (pool, shards, next, first_err, nodes) =
                (&pool, &shards, &next, &first_err, &nodes);
            s.spawn(move || {
                if nodes.len() > 1 {
                    numa::bind_current_thread(&nodes[t % nodes.len()].cpus);
                }
                loop {
                    // ORDERING: a plain work counter; results are joined by the scope.
                    let idx = next.fetch_add(1, Ordering::Relaxed);
                    if idx >= shards.len() || first_err.lock().map(|e| e.is_some()).unwrap_or(true)
                    {
                        break;
                    }
                    let (path, tensors) = &shards[idx];
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        load_shard(pool, path, tensors)
                    }))
                    .unwrap_or_else(|_| {
                        Err(PoolError::Internal(format!(
                            "panic while loading {}",
                            path.display()
                        )))
                    });
                    if let Err(e) = r {
                        if let Ok(mut g) = first_err.lock() {
                            g.get_or_insert(e);
                        }
                        break;
                    }
                }
            });
        }
    });
    match first_err.into_inner() {
        Ok(None) => Ok(pool),
        Ok(Some(e)) => Err(e),
        Err(_) => Err(PoolError::Internal("loader error lock poisoned".into())),
    }
}

/// Packs the listed tensors of one shard. Each target is written by exactly one call (targets
/// are disjoint across shards because the weight map lists each tensor once).
fn load_shard(
    pool: &ExpertPool,
    path: &Path,
    tensors: &[(String, Target)],
) -> Result<(), PoolError> {
    let (_file, mmap) = map_file(path)?;
    let _ = mmap.advise(memmap2::Advice::Sequential);
    let (header, meta) =
        SafeTensors::read_metadata(&mmap).map_err(|e| PoolError::BadSafetensors {
            path: path.into(),
            msg: e.to_string(),
        })?;
    let data_start = 8 + header;
    let (h, i, ne) = (
        pool.hidden_size(),
        pool.intermediate_size(),
        pool.num_experts(),
    );
    for (name, target) in tensors {
        let info = meta.info(name).ok_or_else(|| PoolError::MissingTensor {
            path: path.into(),
            tensor: name.clone(),
            what: "listed in the index but absent from this shard".into(),
        })?;
        let (a, b) = info.data_offsets;
        let src =
            mmap.get(data_start + a..data_start + b)
                .ok_or_else(|| PoolError::BadSafetensors {
                    path: path.into(),
                    msg: format!("tensor {name} data {a}..{b} lies outside the file"),
                })?;
        let dtype = match info.dtype {
            Dtype::BF16 | Dtype::F16 | Dtype::F32 => info.dtype,
            other => {
                return Err(PoolError::BadDtype {
                    path: path.into(),
                    tensor: name.clone(),
                    got: format!("{other:?}"),
                })
            }
        };
        let bad_shape = |expected: String| PoolError::BadShape {
            path: path.into(),
            tensor: name.clone(),
            got: info.shape.clone(),
            expected,
        };
        let s = info.shape.as_slice();
        // SAFETY (all expert_mut calls below): the weight map names each tensor once, so every
        // (layer, expert, part) range is written by one thread only, and the pool is not shared
        // with readers until `load` returns.
        match *target {
            Target::Gate(l, e) | Target::Up(l, e) => {
                if s != [i, h] {
                    return Err(bad_shape(format!(
                        "[{i}, {h}] (moe_intermediate_size, hidden_size)"
                    )));
                }
                let off = if matches!(target, Target::Gate(..)) {
                    0
                } else {
                    i * h
                };
                // SAFETY: one writer per expert part (see above).
                let dst = unsafe { &mut pool.expert_mut(l, e)[off..off + i * h] };
                pack(src, dtype, i, h, false, dst);
            }
            Target::Down(l, e) => {
                if s != [h, i] {
                    return Err(bad_shape(format!(
                        "[{h}, {i}] (hidden_size, moe_intermediate_size)"
                    )));
                }
                // SAFETY: one writer per expert part (see above).
                let dst = unsafe { &mut pool.expert_mut(l, e)[2 * i * h..] };
                pack(src, dtype, h, i, false, dst);
            }
            Target::FusedGateUp(l) => {
                let transposed = if s == [ne, 2 * i, h] {
                    false
                } else if s == [ne, h, 2 * i] {
                    true
                } else {
                    return Err(bad_shape(format!(
                        "[{ne}, {}, {h}] or [{ne}, {h}, {}]",
                        2 * i,
                        2 * i
                    )));
                };
                let per = 2 * i * h * (dtype.bitsize() / 8);
                for e in 0..ne {
                    // SAFETY: one writer per expert part (see above).
                    let dst = unsafe { &mut pool.expert_mut(l, e)[..2 * i * h] };
                    pack(
                        &src[e * per..(e + 1) * per],
                        dtype,
                        2 * i,
                        h,
                        transposed,
                        dst,
                    );
                }
            }
            Target::FusedDown(l) => {
                let transposed = if s == [ne, h, i] {
                    false
                } else if s == [ne, i, h] {
                    true
                } else {
                    return Err(bad_shape(format!("[{ne}, {h}, {i}] or [{ne}, {i}, {h}]")));
                };
                let per = h * i * (dtype.bitsize() / 8);
                for e in 0..ne {
                    // SAFETY: one writer per expert part (see above).
                    let dst = unsafe { &mut pool.expert_mut(l, e)[2 * i * h..] };
                    pack(&src[e * per..(e + 1) * per], dtype, h, i, transposed, dst);
                }
            }
        }
        // Drop the source pages from this process's RSS (the page cache keeps them).
        let page = 4096;
        let lo = (data_start + a).next_multiple_of(page);
        let hi = (data_start + b) / page * page;
        if hi > lo {
            // SAFETY: [lo, hi) lies inside the read-only file mapping, which is not read again
            // after this point for this tensor (tensors do not overlap).
            unsafe {
                libc::madvise(
                    mmap.as_ptr().add(lo) as *mut libc::c_void,
                    hi - lo,
                    libc::MADV_DONTNEED,
                );
            }
        }
    }
    Ok(())
}

/// Writes a `[rows, cols]` row-major bf16 matrix into `dst` from `src`, which holds the same
/// matrix (or its `[cols, rows]` transpose when `transposed`) in `dtype`, little endian.
fn pack(src: &[u8], dtype: Dtype, rows: usize, cols: usize, transposed: bool, dst: &mut [u16]) {
    let es = dtype.bitsize() / 8;
    debug_assert_eq!(src.len(), rows * cols * es);
    let read = |idx: usize| -> u16 {
        let b = &src[idx * es..idx * es + es];
        match dtype {
            Dtype::BF16 => u16::from_le_bytes([b[0], b[1]]),
            Dtype::F16 => f32_to_bf16(f16_to_f32(u16::from_le_bytes([b[0], b[1]]))),
            _ => f32_to_bf16(f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        }
    };
    if !transposed && dtype == Dtype::BF16 {
        for (d, s) in dst[..rows * cols].iter_mut().zip(src.chunks_exact(2)) {
            *d = u16::from_le_bytes([s[0], s[1]]);
        }
        return;
    }
    for r in 0..rows {
        for c in 0..cols {
            dst[r * cols + c] = if transposed {
                read(c * rows + r)
            } else {
                read(r * cols + c)
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(json: &str) -> Result<PoolShape, PoolError> {
        let dir = std::env::temp_dir().join(format!("ftcfg-{}-{}", std::process::id(), json.len()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("config.json");
        std::fs::write(&p, json).unwrap();
        let r = shape_from_config(&p);
        std::fs::remove_dir_all(&dir).ok();
        r
    }

    #[test]
    fn moe_layer_rules() {
        let base = r#""hidden_size": 8, "moe_intermediate_size": 4, "num_hidden_layers": 6"#;
        let s = shape(&format!(
            r#"{{{base}, "num_experts": 4, "mlp_only_layers": [1], "decoder_sparse_step": 2}}"#
        ))
        .unwrap();
        assert_eq!(s.moe_layers, vec![3, 5]);
        let s = shape(&format!(r#"{{{base}, "num_local_experts": 4}}"#)).unwrap();
        assert_eq!((s.moe_layers.len(), s.num_experts), (6, 4));
        let s = shape(&format!(
            r#"{{{base}, "n_routed_experts": 4, "first_k_dense_replace": 1, "moe_layer_freq": 2}}"#
        ))
        .unwrap();
        assert_eq!(s.moe_layers, vec![2, 4]);
        let s = shape(&format!(
            r#"{{"text_config": {{{base}, "num_experts": 2}}}}"#
        ))
        .unwrap();
        assert_eq!(s.num_experts, 2);
        assert!(matches!(
            shape(&format!("{{{base}}}")),
            Err(PoolError::BadConfig { .. })
        ));
        assert!(matches!(shape("{"), Err(PoolError::BadConfig { .. })));
    }
}
