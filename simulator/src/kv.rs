//! vLLM's paged KV cache with automatic prefix caching (the v1 `BlockPool` design).
//!
//! Blocks hold 16 tokens. A full block gets its chained hash and is registered in the
//! cache; when its last user frees it, it goes to the free queue but keeps its hash, so a
//! later request can still hit it until the block is reused. Allocation takes the block at
//! the head of the free queue (least recently freed) and evicts its hash. A finished request
//! frees its blocks tail first, so the tail of a prompt is evicted before its head. A hit on
//! a free block takes it out of the free queue. Two requests that computed the same block
//! each register their copy; a hash stays cached while any copy is, and a hit takes the
//! first copy registered. Block 0 is vLLM's reserved null block, so usage = blocks in use /
//! (num_blocks − 1).

use std::collections::{BTreeMap, HashMap};

pub type BlockId = u32;

#[derive(Clone, Debug)]
struct Block {
    refs: u32,
    hash: Option<u64>,
    /// Position in the free queue, when free.
    free_seq: Option<u64>,
}

#[derive(Clone, Debug)]
pub struct KvCache {
    blocks: Vec<Block>,
    /// Every cached copy of a block, by hash, first registered first.
    cached: HashMap<u64, Vec<BlockId>>,
    free: BTreeMap<u64, BlockId>,
    next_seq: u64,
    used: u64,
    pub evictions: u64,
}

impl KvCache {
    pub fn new(num_blocks: u64) -> KvCache {
        let n = num_blocks.max(2) as usize;
        let mut blocks = vec![
            Block {
                refs: 0,
                hash: None,
                free_seq: None
            };
            n
        ];
        let mut free = BTreeMap::new();
        for (i, b) in blocks.iter_mut().enumerate().skip(1) {
            b.free_seq = Some(i as u64);
            free.insert(i as u64, i as BlockId);
        }
        KvCache {
            blocks,
            cached: HashMap::new(),
            free,
            next_seq: n as u64,
            used: 0,
            evictions: 0,
        }
    }

    pub fn num_blocks(&self) -> u64 {
        self.blocks.len() as u64
    }

    pub fn free_blocks(&self) -> u64 {
        self.free.len() as u64
    }

    /// Fraction of usable blocks referenced by running requests.
    pub fn usage(&self) -> f64 {
        self.used as f64 / (self.blocks.len() - 1) as f64
    }

    /// How many leading blocks of `hashes` are cached (in use or free but not yet reused).
    pub fn cached_prefix(&self, hashes: &[u64]) -> usize {
        hashes.iter().take_while(|h| self.cached.contains_key(h)).count()
    }

    /// Takes a reference on the cached blocks of the first `n` hashes (a prefix hit).
    pub fn acquire_cached(&mut self, hashes: &[u64], n: usize) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(n);
        for h in &hashes[..n] {
            if let Some(&id) = self.cached.get(h).and_then(|ids| ids.first()) {
                self.take_ref(id);
                out.push(id);
            }
        }
        out
    }

    /// A request's blocks: the cached blocks of its first `hits` hashes and `fresh` new
    /// ones, or `None`, touching nothing, when the free queue cannot supply both (a hit on
    /// a free block takes it from that queue too). As vLLM checks before it touches, a
    /// request that does not fit leaves the eviction order as it was.
    pub fn admit(&mut self, hashes: &[u64], hits: usize, fresh: usize) -> Option<Vec<BlockId>> {
        let free_hits = hashes[..hits]
            .iter()
            .filter_map(|h| self.cached.get(h).and_then(|ids| ids.first()))
            .filter(|&&id| self.blocks[id as usize].refs == 0)
            .count();
        if self.free.len() < fresh + free_hits {
            return None;
        }
        let mut out = self.acquire_cached(hashes, hits);
        out.extend(self.allocate(fresh)?);
        Some(out)
    }

    fn take_ref(&mut self, id: BlockId) {
        let b = &mut self.blocks[id as usize];
        if b.refs == 0 {
            if let Some(seq) = b.free_seq.take() {
                self.free.remove(&seq);
            }
            self.used += 1;
        }
        b.refs += 1;
    }

    /// Allocates `n` fresh blocks, or none if fewer than `n` are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if (self.free.len()) < n {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let (_, id) = self.free.pop_first()?;
            let b = &mut self.blocks[id as usize];
            b.free_seq = None;
            if let Some(h) = b.hash.take() {
                if let Some(ids) = self.cached.get_mut(&h) {
                    ids.retain(|&other| other != id);
                    if ids.is_empty() {
                        self.cached.remove(&h);
                    }
                }
                self.evictions += 1;
            }
            b.refs = 1;
            self.used += 1;
            out.push(id);
        }
        Some(out)
    }

    /// Registers a now-full block under its chained hash, beside any copy another request
    /// computed (a block is registered once).
    pub fn register(&mut self, id: BlockId, hash: u64) {
        let b = &mut self.blocks[id as usize];
        if b.hash.is_none() {
            b.hash = Some(hash);
            self.cached.entry(hash).or_default().push(id);
        }
    }

    /// Drops a request's references, tail first.
    pub fn release(&mut self, ids: &[BlockId]) {
        for &id in ids.iter().rev() {
            let b = &mut self.blocks[id as usize];
            debug_assert!(b.refs > 0, "releasing a free block");
            b.refs = b.refs.saturating_sub(1);
            if b.refs == 0 {
                let seq = self.next_seq;
                self.next_seq += 1;
                b.free_seq = Some(seq);
                self.free.insert(seq, id);
                self.used -= 1;
            }
        }
    }

    /// Whether a block with this hash is cached (for the oracle and the KV-event view).
    pub fn contains(&self, hash: u64) -> bool {
        self.cached.contains_key(&hash)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn freed_blocks_stay_hittable_until_reused() {
        let mut kv = KvCache::new(5); // 4 usable
        let ids = kv.allocate(2).unwrap();
        kv.register(ids[0], 10);
        kv.register(ids[1], 11);
        kv.release(&ids);
        assert_eq!(kv.cached_prefix(&[10, 11, 12]), 2);
        let hit = kv.acquire_cached(&[10, 11], 2);
        assert_eq!(hit, ids);
        assert_eq!(kv.free_blocks(), 2, "hit blocks left the free queue");
        assert!((kv.usage() - 0.5).abs() < 1e-9);
    }

    #[test]
    fn the_tail_is_evicted_first() {
        let mut kv = KvCache::new(4); // 3 usable
        let ids = kv.allocate(3).unwrap();
        for (i, id) in ids.iter().enumerate() {
            kv.register(*id, 100 + i as u64);
        }
        kv.release(&ids);
        kv.allocate(1).unwrap();
        assert_eq!(kv.cached_prefix(&[100, 101, 102]), 2, "the last block went first");
        assert_eq!(kv.evictions, 1);
    }

    #[test]
    fn allocation_fails_whole_when_short() {
        let mut kv = KvCache::new(3);
        assert!(kv.allocate(3).is_none());
        assert_eq!(kv.free_blocks(), 2);
        assert!(kv.allocate(2).is_some());
        assert_eq!(kv.usage(), 1.0);
    }

    #[test]
    fn a_shared_block_is_freed_only_by_its_last_user() {
        let mut kv = KvCache::new(4);
        let a = kv.allocate(1).unwrap();
        kv.register(a[0], 7);
        let b = kv.acquire_cached(&[7], 1);
        kv.release(&a);
        assert_eq!(kv.free_blocks(), 2);
        kv.release(&b);
        assert_eq!(kv.free_blocks(), 3);
    }

    #[test]
    fn a_hash_stays_cached_while_a_copy_of_its_block_does() {
        let mut kv = KvCache::new(4); // 3 usable
        let (a, b) = (kv.allocate(1).unwrap(), kv.allocate(1).unwrap());
        kv.register(a[0], 7); // two requests computed the same block
        kv.register(b[0], 7);
        kv.release(&a);
        kv.release(&b);
        kv.allocate(2).unwrap(); // the never-used block, then `a`, the first copy
        assert_eq!(kv.cached_prefix(&[7]), 1, "`b` still holds the block");
        assert_eq!(kv.acquire_cached(&[7], 1), b);
    }

    #[test]
    fn a_request_that_does_not_fit_leaves_the_eviction_order_as_it_was() {
        let mut kv = KvCache::new(5); // 4 usable
        let (old, other) = (kv.allocate(1).unwrap(), kv.allocate(1).unwrap());
        kv.register(old[0], 7);
        kv.release(&old); // cached and free, first in line to be evicted
        kv.release(&other);
        // The two never-used blocks; then a request hits block 7 and needs 2 more: the one
        // other free block is not enough.
        let _busy = kv.allocate(2).unwrap();
        assert!(kv.admit(&[7], 1, 2).is_none());
        assert_eq!(kv.free_blocks(), 2);
        kv.allocate(1).unwrap();
        assert_eq!(kv.cached_prefix(&[7]), 0, "block 7 was still the least recently freed");
        assert_eq!(kv.evictions, 1);
    }

    #[test]
    fn admitting_takes_the_hits_and_the_fresh_blocks() {
        let mut kv = KvCache::new(5);
        let old = kv.allocate(1).unwrap();
        kv.register(old[0], 7);
        kv.release(&old);
        let blocks = kv.admit(&[7, 8], 1, 3).unwrap();
        assert_eq!(blocks.len(), 4);
        assert_eq!(blocks[0], old[0]);
        assert_eq!((kv.free_blocks(), kv.usage()), (0, 1.0));
    }
}
