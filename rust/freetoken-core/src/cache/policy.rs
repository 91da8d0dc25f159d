//! Replacement policies behind one trait: [`Lru`], [`LayerLru`], [`LayerLfu`] and the offline
//! oracle [`MinOracle`] (Belady's MIN).
//!
//! A policy only orders slots; the [`super::SlotMap`] owns the key <-> slot mapping and tells
//! the policy about every hit, insert, removal and move, in order.
//!
//! Why [`LayerLru`]: every token walks layers `0..L-1`, so a global LRU smaller than one token's
//! working set evicts exactly the expert the next token needs at the same layer and can drop to
//! ~0 % hits (peers.md §1.3: BigMoeOnEdge saw 0.0 % at a 1.5 GiB budget). Giving each layer its
//! own LRU with quota `capacity / L` keeps a per-layer LRU's hit rate (peers report
//! per-layer LRU-64 ~67 % and LRU-128 ~81 % for a 128... 256-expert Qwen-class model).
use std::collections::BTreeSet;

use super::{ExpertKey, SlotId};

/// A replacement policy. Calls arrive in access order from the slot map.
pub trait Policy: Send {
    /// Short name (`lru`, `layer_lru`, `min`).
    fn name(&self) -> &'static str;
    /// The capacity changes to `capacity`; grow internal arrays if needed (never shrink: slots
    /// above the new capacity are emptied or moved by the slot map afterwards).
    fn resize(&mut self, capacity: usize);
    /// `key`, resident in `slot`, was used.
    fn on_hit(&mut self, slot: SlotId, key: ExpertKey);
    /// `key` was placed in the empty `slot` (this is also a use).
    fn on_insert(&mut self, slot: SlotId, key: ExpertKey);
    /// `key` left `slot`.
    fn on_remove(&mut self, slot: SlotId, key: ExpertKey);
    /// `key` moved from slot `from` to the empty slot `to`, keeping its rank.
    fn on_move(&mut self, from: SlotId, to: SlotId, key: ExpertKey);
    /// The slot to evict to make room for `incoming` (`None` when shrinking), never one for
    /// which `pinned` is true. `None` when every resident is pinned.
    fn victim(
        &mut self,
        incoming: Option<ExpertKey>,
        pinned: &dyn Fn(SlotId) -> bool,
    ) -> Option<SlotId>;
}

const NIL: u32 = u32::MAX;

/// Intrusive doubly linked lists over slot ids (each slot in at most one list); head = most recent.
#[derive(Debug, Default, Clone)]
struct Lists {
    prev: Vec<u32>,
    next: Vec<u32>,
    list_of: Vec<u32>,
    head: Vec<u32>,
    tail: Vec<u32>,
    len: Vec<usize>,
}

impl Lists {
    fn new(num_lists: usize, capacity: usize) -> Self {
        let mut l = Self {
            head: vec![NIL; num_lists],
            tail: vec![NIL; num_lists],
            len: vec![0; num_lists],
            ..Self::default()
        };
        l.grow(capacity);
        l
    }

    fn grow(&mut self, capacity: usize) {
        if capacity > self.prev.len() {
            self.prev.resize(capacity, NIL);
            self.next.resize(capacity, NIL);
            self.list_of.resize(capacity, NIL);
        }
    }

    fn push_front(&mut self, list: u32, s: u32) {
        let (li, si) = (list as usize, s as usize);
        self.list_of[si] = list;
        self.prev[si] = NIL;
        self.next[si] = self.head[li];
        if self.head[li] != NIL {
            self.prev[self.head[li] as usize] = s;
        } else {
            self.tail[li] = s;
        }
        self.head[li] = s;
        self.len[li] += 1;
    }

    fn unlink(&mut self, s: u32) {
        let si = s as usize;
        let li = self.list_of[si];
        if li == NIL {
            return;
        }
        let li = li as usize;
        let (p, n) = (self.prev[si], self.next[si]);
        if p != NIL {
            self.next[p as usize] = n;
        } else {
            self.head[li] = n;
        }
        if n != NIL {
            self.prev[n as usize] = p;
        } else {
            self.tail[li] = p;
        }
        self.list_of[si] = NIL;
        self.len[li] -= 1;
    }

    fn move_to_front(&mut self, s: u32) {
        let li = self.list_of[s as usize];
        if li != NIL && self.head[li as usize] != s {
            self.unlink(s);
            self.push_front(li, s);
        }
    }

    /// Moves `from`'s position (list and rank) to the unused slot `to`.
    fn relocate(&mut self, from: u32, to: u32) {
        let (fi, ti) = (from as usize, to as usize);
        let li = self.list_of[fi];
        if li == NIL {
            return;
        }
        let (p, n) = (self.prev[fi], self.next[fi]);
        self.prev[ti] = p;
        self.next[ti] = n;
        self.list_of[ti] = li;
        if p != NIL {
            self.next[p as usize] = to;
        } else {
            self.head[li as usize] = to;
        }
        if n != NIL {
            self.prev[n as usize] = to;
        } else {
            self.tail[li as usize] = to;
        }
        self.list_of[fi] = NIL;
    }

    /// Least recent unpinned slot of `list`.
    fn last_unpinned(&self, list: usize, pinned: &dyn Fn(SlotId) -> bool) -> Option<u32> {
        let mut s = self.tail[list];
        while s != NIL {
            if !pinned(s) {
                return Some(s);
            }
            s = self.prev[s as usize];
        }
        None
    }
}

/// Global least-recently-used order over all slots.
#[derive(Debug, Clone)]
pub struct Lru {
    lists: Lists,
}

impl Lru {
    /// An LRU for `capacity` slots.
    pub fn new(capacity: usize) -> Self {
        Self {
            lists: Lists::new(1, capacity),
        }
    }
}

impl Policy for Lru {
    fn name(&self) -> &'static str {
        "lru"
    }
    fn resize(&mut self, capacity: usize) {
        self.lists.grow(capacity);
    }
    fn on_hit(&mut self, slot: SlotId, _key: ExpertKey) {
        self.lists.move_to_front(slot);
    }
    fn on_insert(&mut self, slot: SlotId, _key: ExpertKey) {
        self.lists.push_front(0, slot);
    }
    fn on_remove(&mut self, slot: SlotId, _key: ExpertKey) {
        self.lists.unlink(slot);
    }
    fn on_move(&mut self, from: SlotId, to: SlotId, _key: ExpertKey) {
        self.lists.relocate(from, to);
    }
    fn victim(
        &mut self,
        _incoming: Option<ExpertKey>,
        pinned: &dyn Fn(SlotId) -> bool,
    ) -> Option<SlotId> {
        self.lists.last_unpinned(0, pinned)
    }
}

/// Victim choice shared by the per-layer policies: the `pick` of the incoming key's layer when
/// that layer holds its quota or more; otherwise the `pick` of the layer furthest above its quota
/// (O(L) scan) that has an unpinned slot. `len(l)` is the residents of layer `l`, `pick(l)` its
/// policy's unpinned victim.
fn quota_victim(
    incoming_layer: Option<usize>,
    quota: &[usize],
    len: impl Fn(usize) -> usize,
    pick: impl Fn(usize) -> Option<SlotId>,
) -> Option<SlotId> {
    if let Some(l) = incoming_layer.map(|l| l.min(quota.len() - 1)) {
        if len(l) >= quota[l].max(1) {
            if let Some(s) = pick(l) {
                return Some(s);
            }
        }
    }
    let mut order: Vec<(isize, usize)> = (0..quota.len())
        .filter(|&l| len(l) > 0)
        .map(|l| (len(l) as isize - quota[l] as isize, l))
        .collect();
    order.sort_unstable_by(|a, b| b.cmp(a));
    order.into_iter().find_map(|(_, l)| pick(l))
}

/// One LRU list per layer with a quota per layer: `capacity / L` (the first `capacity % L`
/// layers get one more).
///
/// Victim for an incoming key of layer `l`: the LRU slot of `l` when `l` holds its quota or
/// more; otherwise the LRU slot of the layer furthest above its quota (O(L) scan). Free slots
/// are used first, so a layer may borrow beyond its quota until the cache is full.
#[derive(Debug, Clone)]
pub struct LayerLru {
    lists: Lists,
    quota: Vec<usize>,
}

impl LayerLru {
    /// Per-layer LRU over `num_layers` layers and `capacity` slots.
    pub fn new(capacity: usize, num_layers: usize) -> Self {
        let mut p = Self {
            lists: Lists::new(num_layers.max(1), capacity),
            quota: vec![0; num_layers.max(1)],
        };
        p.set_quotas(capacity);
        p
    }

    fn set_quotas(&mut self, capacity: usize) {
        let n = self.quota.len();
        for (l, q) in self.quota.iter_mut().enumerate() {
            *q = capacity / n + usize::from(l < capacity % n);
        }
    }

    /// The quota of each layer, in slots.
    pub fn quotas(&self) -> &[usize] {
        &self.quota
    }
}

impl Policy for LayerLru {
    fn name(&self) -> &'static str {
        "layer_lru"
    }
    fn resize(&mut self, capacity: usize) {
        self.lists.grow(capacity);
        self.set_quotas(capacity);
    }
    fn on_hit(&mut self, slot: SlotId, _key: ExpertKey) {
        self.lists.move_to_front(slot);
    }
    fn on_insert(&mut self, slot: SlotId, key: ExpertKey) {
        let l = (key.layer as usize).min(self.quota.len() - 1) as u32;
        self.lists.push_front(l, slot);
    }
    fn on_remove(&mut self, slot: SlotId, _key: ExpertKey) {
        self.lists.unlink(slot);
    }
    fn on_move(&mut self, from: SlotId, to: SlotId, _key: ExpertKey) {
        self.lists.relocate(from, to);
    }
    fn victim(
        &mut self,
        incoming: Option<ExpertKey>,
        pinned: &dyn Fn(SlotId) -> bool,
    ) -> Option<SlotId> {
        let len = |l: usize| self.lists.len[l];
        let pick = |l: usize| self.lists.last_unpinned(l, pinned);
        quota_victim(incoming.map(|k| k.layer as usize), &self.quota, len, pick)
    }
}

/// Per-layer quotas (as [`LayerLru`]) and, within a layer, the lowest recency-weighted
/// frequency: LRFU (Lee et al., IEEE TC 2001) with exponential aging.
///
/// Each key's score is `Σ_uses 2^(t_use / half_life)`, `t` counting accesses at the key's layer,
/// kept as a log2 so it never overflows; a newer use outweighs an older one and a use
/// `half_life` accesses old counts half, with no periodic rescan. Scores persist after eviction
/// (history), so a popular expert that was pushed out returns with its weight. Victim selection
/// is O(log capacity) (a `BTreeSet` per layer) plus pinned slots skipped.
#[derive(Debug, Clone)]
pub struct LayerLfu {
    quota: Vec<usize>,
    half_life: f64,
    clock: Vec<u64>,
    /// log2 score per `[layer][expert]`, grown on demand.
    score: Vec<Vec<f64>>,
    /// Score each resident slot is filed under, and its layer.
    slot_score: Vec<(u64, u32)>,
    sets: Vec<BTreeSet<(u64, SlotId)>>,
}

impl LayerLfu {
    /// Per-layer LRFU over `num_layers` layers and `capacity` slots, aging with a half-life of
    /// `half_life` accesses per layer (e.g. 16 · top_k: sixteen decode steps at batch 1).
    pub fn new(capacity: usize, num_layers: usize, half_life: f64) -> Self {
        let n = num_layers.max(1);
        let mut p = Self {
            quota: vec![0; n],
            half_life: half_life.max(1.0),
            clock: vec![0; n],
            score: vec![Vec::new(); n],
            slot_score: Vec::new(),
            sets: vec![BTreeSet::new(); n],
        };
        p.resize(capacity);
        p
    }

    fn layer(&self, key: ExpertKey) -> usize {
        (key.layer as usize).min(self.quota.len() - 1)
    }

    /// Adds a use of `key` now and returns its new score (as order-preserving bits).
    fn bump(&mut self, key: ExpertKey) -> u64 {
        let l = self.layer(key);
        self.clock[l] += 1;
        let now = self.clock[l] as f64 / self.half_life;
        let row = &mut self.score[l];
        if row.len() <= key.expert as usize {
            row.resize(key.expert as usize + 1, f64::NEG_INFINITY);
        }
        let s = row[key.expert as usize];
        let (hi, lo) = if s > now { (s, now) } else { (now, s) };
        let new = hi + (1.0 + (lo - hi).exp2()).log2();
        row[key.expert as usize] = new;
        // Scores are >= 1/half_life > 0, so the IEEE bits order like the values.
        new.to_bits()
    }

    fn file(&mut self, slot: SlotId, layer: usize, bits: u64) {
        self.slot_score[slot as usize] = (bits, layer as u32);
        self.sets[layer].insert((bits, slot));
    }

    fn unfile(&mut self, slot: SlotId) {
        let (bits, l) = self.slot_score[slot as usize];
        self.sets[l as usize].remove(&(bits, slot));
    }

    fn lowest_unpinned(&self, l: usize, pinned: &dyn Fn(SlotId) -> bool) -> Option<SlotId> {
        self.sets[l]
            .iter()
            .find(|(_, s)| !pinned(*s))
            .map(|&(_, s)| s)
    }
}

impl Policy for LayerLfu {
    fn name(&self) -> &'static str {
        "lfu"
    }
    fn resize(&mut self, capacity: usize) {
        if capacity > self.slot_score.len() {
            self.slot_score.resize(capacity, (0, 0));
        }
        let n = self.quota.len();
        for (l, q) in self.quota.iter_mut().enumerate() {
            *q = capacity / n + usize::from(l < capacity % n);
        }
    }
    fn on_hit(&mut self, slot: SlotId, key: ExpertKey) {
        self.unfile(slot);
        let bits = self.bump(key);
        self.file(slot, self.layer(key), bits);
    }
    fn on_insert(&mut self, slot: SlotId, key: ExpertKey) {
        let bits = self.bump(key);
        self.file(slot, self.layer(key), bits);
    }
    fn on_remove(&mut self, slot: SlotId, _key: ExpertKey) {
        self.unfile(slot);
    }
    fn on_move(&mut self, from: SlotId, to: SlotId, _key: ExpertKey) {
        let (bits, l) = self.slot_score[from as usize];
        self.unfile(from);
        self.file(to, l as usize, bits);
    }
    fn victim(
        &mut self,
        incoming: Option<ExpertKey>,
        pinned: &dyn Fn(SlotId) -> bool,
    ) -> Option<SlotId> {
        let len = |l: usize| self.sets[l].len();
        let pick = |l: usize| self.lowest_unpinned(l, pinned);
        quota_victim(incoming.map(|k| k.layer as usize), &self.quota, len, pick)
    }
}

/// Belady's MIN: evicts the resident whose next use lies furthest in the future.
///
/// An offline oracle for benchmarks: built from the exact sequence of accesses (hits and
/// inserts, in the order the slot map will see them); each `on_hit`/`on_insert` consumes one
/// position. Victim selection is O(log capacity) plus pinned slots skipped.
#[derive(Debug, Clone)]
pub struct MinOracle {
    keys: Vec<ExpertKey>,
    /// `next_use[i]`: position of the next access to `keys[i]` after `i`, or `usize::MAX`.
    next_use: Vec<usize>,
    cursor: usize,
    /// Next use of each slot's resident.
    slot_next: Vec<usize>,
    order: BTreeSet<(usize, SlotId)>,
}

impl MinOracle {
    /// An oracle for the access sequence `keys` (and `capacity` slots).
    pub fn new(keys: Vec<ExpertKey>, capacity: usize) -> Self {
        let mut next_use = vec![usize::MAX; keys.len()];
        let mut last: std::collections::HashMap<ExpertKey, usize> =
            std::collections::HashMap::new();
        for (i, k) in keys.iter().enumerate().rev() {
            if let Some(&j) = last.get(k) {
                next_use[i] = j;
            }
            last.insert(*k, i);
        }
        Self {
            keys,
            next_use,
            cursor: 0,
            slot_next: vec![usize::MAX; capacity],
            order: BTreeSet::new(),
        }
    }

    fn use_slot(&mut self, slot: SlotId, key: ExpertKey) {
        let i = self.cursor;
        self.cursor += 1;
        // Off the trace (a caller diverged): treat as never used again.
        let nu = if self.keys.get(i) == Some(&key) {
            self.next_use[i]
        } else {
            usize::MAX
        };
        self.order.remove(&(self.slot_next[slot as usize], slot));
        self.slot_next[slot as usize] = nu;
        self.order.insert((nu, slot));
    }
}

impl Policy for MinOracle {
    fn name(&self) -> &'static str {
        "min"
    }
    fn resize(&mut self, capacity: usize) {
        if capacity > self.slot_next.len() {
            self.slot_next.resize(capacity, usize::MAX);
        }
    }
    fn on_hit(&mut self, slot: SlotId, key: ExpertKey) {
        self.use_slot(slot, key);
    }
    fn on_insert(&mut self, slot: SlotId, key: ExpertKey) {
        self.use_slot(slot, key);
    }
    fn on_remove(&mut self, slot: SlotId, _key: ExpertKey) {
        self.order.remove(&(self.slot_next[slot as usize], slot));
    }
    fn on_move(&mut self, from: SlotId, to: SlotId, _key: ExpertKey) {
        let nu = self.slot_next[from as usize];
        self.order.remove(&(nu, from));
        self.slot_next[to as usize] = nu;
        self.order.insert((nu, to));
    }
    fn victim(
        &mut self,
        _incoming: Option<ExpertKey>,
        pinned: &dyn Fn(SlotId) -> bool,
    ) -> Option<SlotId> {
        self.order
            .iter()
            .rev()
            .find(|(_, s)| !pinned(*s))
            .map(|&(_, s)| s)
    }
}

#[cfg(test)]
mod tests {
    use super::super::SlotMap;
    use super::*;

    fn run(keys: &[(u32, u32)], cap: usize, policy: Box<dyn Policy>) -> usize {
        let mut m = SlotMap::new(cap, 2, 8, policy).unwrap();
        let mut hits = 0;
        for &(l, e) in keys {
            m.unpin_all();
            if m.touch(l as i64, e as i64).unwrap().is_some() {
                hits += 1;
            } else {
                m.insert(l as i64, e as i64).unwrap();
            }
        }
        hits
    }

    #[test]
    fn lfu_keeps_the_popular_expert() {
        // Expert 0 is used every other access, the others once each: LRU with 2 slots keeps
        // losing expert 0 to the stream of one-off experts only when they are recent; LFU keeps it.
        let mut keys = Vec::new();
        for i in 1..60u32 {
            keys.push((0, 0));
            keys.push((0, 1 + i % 7));
            keys.push((0, 1 + (i + 3) % 7));
        }
        let lfu = run(&keys, 2, Box::new(LayerLfu::new(2, 2, 16.0)));
        assert!(lfu >= 55, "{lfu}");
    }

    #[test]
    fn min_beats_lru_on_a_cycle() {
        let keys: Vec<(u32, u32)> = (0..40).map(|i| (0, i % 4)).collect();
        let trace: Vec<ExpertKey> = keys
            .iter()
            .map(|&(l, e)| ExpertKey {
                layer: l,
                expert: e,
            })
            .collect();
        let lru = run(&keys, 3, Box::new(Lru::new(3)));
        let min = run(&keys, 3, Box::new(MinOracle::new(trace, 3)));
        assert_eq!(lru, 0);
        // MIN on a cycle of 4 with 3 slots: misses once every 3 accesses after warmup (~24 hits).
        assert!(min >= 24, "{min}");
    }
}
