//! The expert cache's slot map: `(layer, expert)` -> slot id, fixed capacity, pluggable policy.
//!
//! Owns: which expert sits in which GPU slot, pins of the step in flight, and the replacement
//! policy ([`policy`]). Not: the GPU buffers (Python owns them; this only hands out ids) or
//! hit/fill counters (the [`crate::planner`] keeps those).
//!
//! Every operation is O(1) except eviction, which walks the policy's order past pinned slots
//! (at most the pins of one layer step) and, for `layer_lru`, scans the layers (O(L)).
//! Pins: [`SlotMap::touch`] and [`SlotMap::insert`] pin the slot they return until
//! [`SlotMap::unpin_all`] (an epoch bump, O(1)); a pinned slot is never chosen as a victim.
pub mod policy;

use crate::error::CacheError;
pub use policy::{LayerLfu, LayerLru, Lru, MinOracle, Policy};

/// A GPU expert slot index, `0..capacity`.
pub type SlotId = u32;

/// `(pool layer, expert)`: the key of a cached expert.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ExpertKey {
    /// Pool layer (index into the pool's MoE layers).
    pub layer: u32,
    /// Expert id within the layer.
    pub expert: u32,
}

/// A resident expert moved by [`SlotMap::resize`]: copy GPU slot `from` into `to`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Relocation {
    /// The expert.
    pub key: ExpertKey,
    /// Old slot (>= the new capacity).
    pub from: SlotId,
    /// New slot (< the new capacity).
    pub to: SlotId,
}

const NONE: u32 = u32::MAX;

/// Half-life of the `lfu` policy's aging, in accesses per layer (128 = 16 decode steps of a
/// top-8 model at batch 1).
pub const LFU_HALF_LIFE: f64 = 128.0;

/// Builds a policy by name: `lru` (global LRU), `layer_lru` (per-layer LRU with quotas
/// `capacity / num_layers`), `lfu` (per-layer quotas, LRFU aging: [`LayerLfu`]), or `min`
/// (needs the future: use [`MinOracle::new`] directly).
pub fn policy_by_name(
    name: &str,
    capacity: usize,
    num_layers: usize,
) -> Result<Box<dyn Policy>, CacheError> {
    match name {
        "lru" => Ok(Box::new(Lru::new(capacity))),
        "layer_lru" => Ok(Box::new(LayerLru::new(capacity, num_layers))),
        "lfu" => Ok(Box::new(LayerLfu::new(capacity, num_layers, LFU_HALF_LIFE))),
        other => Err(CacheError::UnknownPolicy(other.to_string())),
    }
}

/// Map from `(layer, expert)` to slot ids of a fixed capacity.
pub struct SlotMap {
    num_layers: usize,
    num_experts: usize,
    capacity: usize,
    /// Per flat key `layer * E + expert`: its slot or NONE.
    slot_of: Vec<u32>,
    /// Per slot: its flat key or NONE.
    key_of: Vec<u32>,
    /// Free slots; popped from the end, so the lowest ids are used first.
    free: Vec<u32>,
    /// A slot is pinned when `pin_epoch[slot] == epoch`.
    pin_epoch: Vec<u64>,
    epoch: u64,
    policy: Box<dyn Policy>,
}

impl SlotMap {
    /// An empty map of `capacity` slots over `num_layers x num_experts` keys.
    pub fn new(
        capacity: usize,
        num_layers: usize,
        num_experts: usize,
        policy: Box<dyn Policy>,
    ) -> Result<Self, CacheError> {
        if num_layers == 0 || num_experts == 0 {
            return Err(CacheError::Invalid(format!(
                "num_layers ({num_layers}) and num_experts ({num_experts}) must be positive"
            )));
        }
        let keys = num_layers
            .checked_mul(num_experts)
            .filter(|&k| k < NONE as usize);
        let keys = keys.ok_or_else(|| {
            CacheError::Invalid("num_layers * num_experts must be below 2^32".into())
        })?;
        if capacity >= NONE as usize {
            return Err(CacheError::Invalid(format!(
                "capacity {capacity} must be below 2^32"
            )));
        }
        let mut policy = policy;
        policy.resize(capacity);
        Ok(Self {
            num_layers,
            num_experts,
            capacity,
            slot_of: vec![NONE; keys],
            key_of: vec![NONE; capacity],
            free: (0..capacity as u32).rev().collect(),
            pin_epoch: vec![0; capacity],
            epoch: 1,
            policy,
        })
    }

    /// Slots in the map.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Resident experts.
    pub fn len(&self) -> usize {
        self.capacity - self.free.len()
    }

    /// True when no expert is resident.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Layers covered.
    pub fn num_layers(&self) -> usize {
        self.num_layers
    }

    /// Experts per layer covered.
    pub fn num_experts(&self) -> usize {
        self.num_experts
    }

    /// The policy's name.
    pub fn policy_name(&self) -> &'static str {
        self.policy.name()
    }

    /// Checks a key and returns its flat index.
    #[inline]
    pub fn flat(&self, layer: i64, expert: i64) -> Result<usize, CacheError> {
        if layer < 0
            || expert < 0
            || layer as usize >= self.num_layers
            || expert as usize >= self.num_experts
        {
            return Err(CacheError::KeyOutOfRange {
                layer,
                expert,
                num_layers: self.num_layers,
                num_experts: self.num_experts,
            });
        }
        Ok(layer as usize * self.num_experts + expert as usize)
    }

    #[inline]
    fn key(&self, flat: u32) -> ExpertKey {
        ExpertKey {
            layer: flat / self.num_experts as u32,
            expert: flat % self.num_experts as u32,
        }
    }

    /// The slot of `(layer, expert)`, without touching the policy or pins.
    pub fn get(&self, layer: i64, expert: i64) -> Result<Option<SlotId>, CacheError> {
        let f = self.flat(layer, expert)?;
        Ok(Some(self.slot_of[f]).filter(|&s| s != NONE))
    }

    /// The expert in `slot`, if any.
    pub fn resident(&self, slot: SlotId) -> Option<ExpertKey> {
        self.key_of
            .get(slot as usize)
            .copied()
            .filter(|&k| k != NONE)
            .map(|k| self.key(k))
    }

    /// Looks up `(layer, expert)` by flat index; on a hit tells the policy and pins the slot.
    #[inline]
    pub fn touch_flat(&mut self, flat: usize) -> Option<SlotId> {
        let s = self.slot_of[flat];
        if s == NONE {
            return None;
        }
        let key = self.key(flat as u32);
        self.policy.on_hit(s, key);
        self.pin_epoch[s as usize] = self.epoch;
        Some(s)
    }

    /// Looks up `(layer, expert)`; on a hit tells the policy and pins the slot.
    pub fn touch(&mut self, layer: i64, expert: i64) -> Result<Option<SlotId>, CacheError> {
        let f = self.flat(layer, expert)?;
        Ok(self.touch_flat(f))
    }

    /// Places an absent `(layer, expert)` (flat index) in a free slot, or in the policy's victim's
    /// slot; pins it. Returns the slot and the evicted key, if any.
    pub fn insert_flat(&mut self, flat: usize) -> Result<(SlotId, Option<ExpertKey>), CacheError> {
        debug_assert_eq!(self.slot_of[flat], NONE, "insert of a resident key");
        let key = self.key(flat as u32);
        let (slot, victim) = match self.free.pop() {
            Some(s) => (s, None),
            None => {
                let (pin_epoch, epoch) = (&self.pin_epoch, self.epoch);
                let pinned = |s: SlotId| pin_epoch[s as usize] == epoch;
                let s = self
                    .policy
                    .victim(Some(key), &pinned)
                    .ok_or(CacheError::AllPinned {
                        capacity: self.capacity,
                    })?;
                let old = self.key_of[s as usize];
                debug_assert!(old != NONE && !pinned(s));
                let old_key = self.key(old);
                self.policy.on_remove(s, old_key);
                self.slot_of[old as usize] = NONE;
                (s, Some(old_key))
            }
        };
        self.slot_of[flat] = slot;
        self.key_of[slot as usize] = flat as u32;
        self.pin_epoch[slot as usize] = self.epoch;
        self.policy.on_insert(slot, key);
        Ok((slot, victim))
    }

    /// Places an absent `(layer, expert)`; see [`SlotMap::insert_flat`]. A resident key is
    /// touched instead and returned with no victim.
    pub fn insert(
        &mut self,
        layer: i64,
        expert: i64,
    ) -> Result<(SlotId, Option<ExpertKey>), CacheError> {
        let f = self.flat(layer, expert)?;
        if let Some(s) = self.touch_flat(f) {
            return Ok((s, None));
        }
        self.insert_flat(f)
    }

    /// Removes `(layer, expert)` if resident (even if pinned); returns its former slot.
    pub fn remove(&mut self, layer: i64, expert: i64) -> Result<Option<SlotId>, CacheError> {
        let f = self.flat(layer, expert)?;
        let s = self.slot_of[f];
        if s == NONE {
            return Ok(None);
        }
        self.policy.on_remove(s, self.key(f as u32));
        self.slot_of[f] = NONE;
        self.key_of[s as usize] = NONE;
        self.pin_epoch[s as usize] = 0;
        self.free.push(s);
        Ok(Some(s))
    }

    /// Whether `slot` is pinned by the step in flight.
    pub fn is_pinned(&self, slot: SlotId) -> bool {
        self.pin_epoch
            .get(slot as usize)
            .is_some_and(|&e| e == self.epoch)
    }

    /// Releases every pin (call once the step that used them no longer reads its slots).
    pub fn unpin_all(&mut self) {
        self.epoch += 1;
    }

    /// Changes the capacity at a safe point (no step in flight: all pins are released).
    ///
    /// Growing keeps every resident. Shrinking evicts the policy's victims until the residents
    /// fit, then moves residents of slots `>= capacity` into free lower slots; the returned
    /// relocations tell the caller which GPU slot contents to copy (`from` -> `to`).
    pub fn resize(&mut self, capacity: usize) -> Result<Vec<Relocation>, CacheError> {
        if capacity >= NONE as usize {
            return Err(CacheError::Invalid(format!(
                "capacity {capacity} must be below 2^32"
            )));
        }
        self.unpin_all();
        let old = self.capacity;
        self.policy.resize(capacity);
        if capacity >= old {
            self.key_of.resize(capacity, NONE);
            self.pin_epoch.resize(capacity, 0);
            // Keep lowest-first order: new slots go below the existing free ones on the stack.
            let mut free: Vec<u32> = (old as u32..capacity as u32).rev().collect();
            free.extend_from_slice(&self.free);
            self.free = free;
            self.capacity = capacity;
            return Ok(Vec::new());
        }
        let nopin = |_: SlotId| false;
        while self.len() > capacity {
            let s = self.policy.victim(None, &nopin).ok_or(CacheError::Invalid(
                "policy found no victim while shrinking".into(),
            ))?;
            let k = self.key(self.key_of[s as usize]);
            self.remove(k.layer as i64, k.expert as i64)?;
        }
        let mut low_free: Vec<u32> = (0..capacity as u32)
            .rev()
            .filter(|&s| self.key_of[s as usize] == NONE)
            .collect();
        let mut moves = Vec::new();
        for from in capacity as u32..old as u32 {
            let flat = self.key_of[from as usize];
            if flat == NONE {
                continue;
            }
            let to = low_free
                .pop()
                .ok_or(CacheError::Invalid("no free slot while compacting".into()))?;
            let key = self.key(flat);
            self.policy.on_move(from, to, key);
            self.key_of[to as usize] = flat;
            self.key_of[from as usize] = NONE;
            self.slot_of[flat as usize] = to;
            moves.push(Relocation { key, from, to });
        }
        self.key_of.truncate(capacity);
        self.pin_epoch.truncate(capacity);
        self.free = low_free;
        self.capacity = capacity;
        Ok(moves)
    }

    /// Every resident `(key, slot)`, in slot order.
    pub fn residents(&self) -> Vec<(ExpertKey, SlotId)> {
        self.key_of
            .iter()
            .enumerate()
            .filter(|(_, &k)| k != NONE)
            .map(|(s, &k)| (self.key(k), s as SlotId))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn map(cap: usize, policy: &str) -> SlotMap {
        SlotMap::new(cap, 4, 8, policy_by_name(policy, cap, 4).unwrap()).unwrap()
    }

    #[test]
    fn lru_evicts_least_recent_and_respects_pins() {
        let mut m = map(2, "lru");
        assert_eq!(m.insert(0, 0).unwrap(), (0, None));
        assert_eq!(m.insert(0, 1).unwrap(), (1, None));
        assert!(matches!(m.insert(0, 2), Err(CacheError::AllPinned { .. })));
        m.unpin_all();
        m.touch(0, 0).unwrap();
        m.unpin_all();
        let (s, v) = m.insert(0, 2).unwrap();
        assert_eq!(
            (s, v),
            (
                1,
                Some(ExpertKey {
                    layer: 0,
                    expert: 1
                })
            )
        );
        assert_eq!(m.get(0, 1).unwrap(), None);
        assert!(m.get(4, 0).is_err() && m.get(0, 8).is_err() && m.get(-1, 0).is_err());
    }

    #[test]
    fn resize_keeps_residents() {
        let mut m = map(6, "lru");
        for e in 0..6 {
            m.insert(1, e).unwrap();
        }
        m.unpin_all();
        m.touch(1, 5).unwrap();
        m.touch(1, 4).unwrap();
        let moves = m.resize(3).unwrap();
        assert_eq!(m.len(), 3);
        // kept: the three most recent: 4, 5, and 3 (inserted last before the touches)
        for e in [3, 4, 5] {
            let s = m.get(1, e).unwrap().expect("kept");
            assert!(s < 3);
        }
        assert!(moves.iter().all(|r| r.from >= 3 && r.to < 3));
        m.resize(5).unwrap();
        assert_eq!(m.len(), 3);
        m.insert(2, 0).unwrap();
        m.insert(2, 1).unwrap();
        assert_eq!(m.len(), 5);
    }

    #[test]
    fn layer_lru_keeps_quotas() {
        // 4 layers, capacity 8 (quota 2 per layer). Per token, layer 0 walks 8 experts (a hungry
        // layer) and layers 1..3 use expert 0. The global LRU lets layer 0 flush everything
        // (0 hits); the per-layer LRU keeps layers 1..3 resident.
        let mut hits = [0usize; 2];
        for (i, p) in ["lru", "layer_lru"].iter().enumerate() {
            let mut m = map(8, p);
            for _ in 0..50 {
                for l in 0..4 {
                    for e in 0..(if l == 0 { 8 } else { 1 }) {
                        if m.touch(l, e).unwrap().is_some() {
                            hits[i] += 1;
                        } else {
                            m.insert(l, e).unwrap();
                        }
                        m.unpin_all();
                    }
                }
            }
        }
        assert_eq!(hits[0], 0);
        assert_eq!(hits[1], 3 * 49, "{hits:?}");
    }

    proptest! {
        // The slot map against a simple model: a Vec of (key, last use) with LRU eviction.
        #[test]
        fn lru_matches_model(ops in proptest::collection::vec((0i64..3, 0i64..5, 0u8..10), 1..300), cap in 1usize..8) {
            let mut m = SlotMap::new(cap, 3, 5, Box::new(Lru::new(cap))).unwrap();
            let mut model: Vec<((i64, i64), usize)> = Vec::new();
            for (t, (l, e, op)) in ops.into_iter().enumerate() {
                m.unpin_all();
                match op {
                    0 => {
                        let was = model.iter().position(|x| x.0 == (l, e));
                        prop_assert_eq!(m.remove(l, e).unwrap().is_some(), was.is_some());
                        if let Some(p) = was { model.remove(p); }
                    }
                    1 => {
                        let newcap = (t % 7) + 1;
                        m.resize(newcap).unwrap();
                        model.sort_by_key(|x| std::cmp::Reverse(x.1));
                        model.truncate(newcap);
                    }
                    _ => {
                        if let Some(p) = model.iter().position(|x| x.0 == (l, e)) {
                            prop_assert!(m.touch(l, e).unwrap().is_some());
                            model[p].1 = t;
                        } else {
                            prop_assert!(m.touch(l, e).unwrap().is_none());
                            let (_, victim) = m.insert(l, e).unwrap();
                            if model.len() == m.capacity() {
                                let (p, _) = model.iter().enumerate().min_by_key(|x| x.1 .1).unwrap();
                                let old = model.remove(p).0;
                                prop_assert_eq!(victim, Some(ExpertKey { layer: old.0 as u32, expert: old.1 as u32 }));
                            } else {
                                prop_assert_eq!(victim, None);
                            }
                            model.push(((l, e), t));
                        }
                    }
                }
                prop_assert_eq!(m.len(), model.len());
                let mut slots: Vec<SlotId> = m.residents().iter().map(|x| x.1).collect();
                slots.sort();
                slots.dedup();
                prop_assert_eq!(slots.len(), model.len());
                prop_assert!(slots.iter().all(|&s| (s as usize) < m.capacity()));
            }
        }
    }

    proptest! {
        // Every policy: slots unique and < capacity, pinned slots never evicted, len <= capacity.
        #[test]
        fn policy_invariants(ops in proptest::collection::vec((0i64..3, 0i64..6, 0u8..12), 1..300), cap in 1usize..10, pi in 0usize..3) {
            let name = ["lru", "layer_lru", "lfu"][pi];
            let mut m = SlotMap::new(cap, 3, 6, policy_by_name(name, cap, 3).unwrap()).unwrap();
            let mut pinned: Vec<ExpertKey> = Vec::new();
            for (l, e, op) in ops {
                match op {
                    0 => { m.unpin_all(); pinned.clear(); }
                    1 => { m.resize(1 + (e as usize + l as usize) % 9).unwrap(); pinned.clear(); }
                    2 => { m.remove(l, e).unwrap(); pinned.retain(|k| *k != ExpertKey { layer: l as u32, expert: e as u32 }); }
                    _ => {
                        match m.insert(l, e) {
                            Ok((s, victim)) => {
                                prop_assert!((s as usize) < m.capacity());
                                if let Some(v) = victim { prop_assert!(!pinned.contains(&v), "{name} evicted a pinned expert"); }
                                pinned.push(ExpertKey { layer: l as u32, expert: e as u32 });
                            }
                            Err(CacheError::AllPinned { .. }) => prop_assert!(m.len() == m.capacity()),
                            Err(other) => prop_assert!(false, "{other}"),
                        }
                    }
                }
                let res = m.residents();
                prop_assert!(res.len() == m.len() && m.len() <= m.capacity());
                for k in &pinned { prop_assert!(m.get(k.layer as i64, k.expert as i64).unwrap().is_some()); }
                let mut slots: Vec<SlotId> = res.iter().map(|x| x.1).collect();
                slots.sort(); slots.dedup();
                prop_assert_eq!(slots.len(), res.len());
            }
        }
    }
}
