//! Tile alignment of (token, expert) pairs for the GPU grouped SwiGLU kernel.
//!
//! The Triton kernel (`python/freetoken/kernels/fused_moe.py`) computes one expert per M tile of
//! `block_m` rows, so the pairs are sorted by expert (or cache slot) and each expert's group is
//! padded to a multiple of `block_m` (the alignment of vLLM's `moe_align_block_size`, Kwon et al.,
//! SOSP 2023). The planner already has the slot ids on the host, so the alignment is made here, in
//! microseconds, and sent with them in one copy instead of running sorting kernels on the device.

/// Rows and tiles of the aligned layout: `(num_rows, num_tiles)`, with
/// `num_rows = num_pairs + min(num_pairs, num_experts + 1) * (block_m - 1)` rounded up to
/// `block_m` (an upper bound of the padded total: each non-empty group pads at most
/// `block_m - 1` rows), and `num_tiles = num_rows / block_m`.
pub fn aligned_len(num_pairs: usize, num_experts: usize, block_m: usize) -> (usize, usize) {
    let rows = num_pairs + num_pairs.min(num_experts + 1) * (block_m - 1);
    let rows = rows.div_ceil(block_m) * block_m;
    (rows, rows / block_m)
}

/// Sorts pairs by expert and pads each expert's group to a multiple of `block_m`.
///
/// `ids[p]` is the expert (or slot) of pair `p = token * k + j`, negative for a pair computed
/// elsewhere (on the CPU). Writes `sorted_pairs[num_rows]` (the pair of each row, `ids.len()` on
/// padding rows; experts in ascending order, pairs ascending within one) and
/// `tile_expert[num_tiles]` (the expert of each tile, -1 for tiles of skipped pairs or past the
/// end), sized by [`aligned_len`].
///
/// # Panics
/// If an id is `>= num_experts`, `block_m == 0`, or an output has the wrong length.
pub fn align_pairs(
    ids: &[i64],
    num_experts: usize,
    block_m: usize,
    sorted_pairs: &mut [i64],
    tile_expert: &mut [i64],
) {
    let (rows, tiles) = aligned_len(ids.len(), num_experts, block_m);
    assert_eq!(sorted_pairs.len(), rows, "sorted_pairs length");
    assert_eq!(tile_expert.len(), tiles, "tile_expert length");
    // Sorting the pairs costs O(pairs log pairs), independent of the number of experts: a decode
    // step has 8-512 pairs over thousands of cache slots, where counting per slot cost ~15 us.
    // Skipped pairs go to bucket `num_experts`, after every expert; (bucket, pair) keys are
    // distinct, so the order is the stable one.
    let mut order: Vec<(usize, usize)> = ids
        .iter()
        .enumerate()
        .map(|(p, &id)| {
            let b = if id < 0 { num_experts } else { id as usize };
            assert!(
                b <= num_experts,
                "id {id} out of range for {num_experts} experts"
            );
            (b, p)
        })
        .collect();
    order.sort_unstable();
    sorted_pairs.fill(ids.len() as i64);
    tile_expert.fill(-1);
    let mut row = 0;
    for group in order.chunk_by(|a, b| a.0 == b.0) {
        for (dst, &(_, p)) in sorted_pairs[row..].iter_mut().zip(group) {
            *dst = p as i64;
        }
        let padded = group.len().div_ceil(block_m) * block_m;
        let bucket = group[0].0;
        if bucket < num_experts {
            tile_expert[row / block_m..(row + padded) / block_m].fill(bucket as i64);
        }
        row += padded;
    }
}

/// The plan layout the GPU kernel reads in one piece: `buf` holds `num_pairs` ids (as for
/// [`align_pairs`]), followed here by their sorted pairs and tile experts. Returns
/// `(num_rows, num_tiles)`.
///
/// # Panics
/// If `buf` is shorter than `num_pairs + num_rows + num_tiles`, or as [`align_pairs`].
pub fn align_after(
    buf: &mut [i64],
    num_pairs: usize,
    num_experts: usize,
    block_m: usize,
) -> (usize, usize) {
    let (rows, tiles) = aligned_len(num_pairs, num_experts, block_m);
    let (ids, rest) = buf.split_at_mut(num_pairs);
    let (pairs, rest) = rest.split_at_mut(rows);
    align_pairs(ids, num_experts, block_m, pairs, &mut rest[..tiles]);
    (rows, tiles)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A plain reference: stable sort by bucket, pad each group, mark tiles.
    fn reference(ids: &[i64], e: usize, bm: usize) -> (Vec<i64>, Vec<i64>) {
        let (rows, tiles) = aligned_len(ids.len(), e, bm);
        let mut rows_out = Vec::new();
        let mut tiles_out = Vec::new();
        for x in 0..=e {
            let group: Vec<i64> = (0..ids.len())
                .filter(|&p| (if ids[p] < 0 { e } else { ids[p] as usize }) == x)
                .map(|p| p as i64)
                .collect();
            let padded = group.len().div_ceil(bm) * bm;
            rows_out.extend(group.iter().copied());
            rows_out.extend(std::iter::repeat_n(ids.len() as i64, padded - group.len()));
            tiles_out.extend(std::iter::repeat_n(
                if x < e { x as i64 } else { -1 },
                padded / bm,
            ));
        }
        rows_out.resize(rows, ids.len() as i64);
        tiles_out.resize(tiles, -1);
        (rows_out, tiles_out)
    }

    #[test]
    fn matches_the_reference() {
        let mut seed = 7u64;
        for &(n, e, bm) in &[
            (1, 4, 16),
            (8, 128, 16),
            (37, 9, 4),
            (512, 300, 64),
            (3, 1, 1),
            (8, 2356, 16),
            (512, 2356, 64),
            (0, 5, 16),
        ] {
            let ids: Vec<i64> = (0..n)
                .map(|_| {
                    seed = seed
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    (seed >> 33) as i64 % (e as i64 + 1) - 1
                })
                .collect();
            let (rows, tiles) = aligned_len(n, e, bm);
            let (mut sp, mut te) = (vec![0; rows], vec![0; tiles]);
            align_pairs(&ids, e, bm, &mut sp, &mut te);
            assert_eq!((sp, te), reference(&ids, e, bm), "n={n} e={e} bm={bm}");
        }
    }
}
