//! The prefix index: which endpoint probably holds which prefix blocks.
//!
//! Blocks are recorded when a request is routed (so a burst of siblings lands together
//! before any feedback exists) and aged out per endpoint in LRU order. Each endpoint's
//! capacity comes from its real KV size (`num_gpu_blocks × block_size`, converted to our
//! blocks); the sum of capacities is scaled down to fit one global memory budget, so the
//! index never holds more than `max_memory_bytes / ENTRY_BYTES` (endpoint, block) entries.
//!
//! A request's blocks are touched last-to-first, so its first block is the most recently
//! used and its tail is evicted first, as vLLM frees a finished request's blocks tail-first.
//! The LRU is a queue with lazy deletion: a touch appends a new (block, tick) pair and stale
//! pairs are skipped when popped; the queue is compacted when it doubles.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};

use crate::endpoint::Slot;
use crate::types::BlockHash;

/// A conservative estimate of the bytes one (endpoint, block) entry costs across the holder
/// map, the endpoint's map and its LRU queue (including lazily deleted queue entries), and
/// its share of the endpoint's list of evicted blocks (`Ghosts`, half as many, at about 26
/// bytes each). The conversations' roots (`Root`, one per prompt of `Root::MIN_BLOCKS` or
/// more, about 40 bytes each) add at most 5 bytes an entry, within the estimate's margin.
pub const ENTRY_BYTES: usize = 144;

/// Block hashes are already uniform SHA-256 bits: hashing them again is wasted work, and
/// an identity hasher keeps iteration independent of any per-process random seed.
#[derive(Default, Clone, Copy)]
pub struct IdentityHasher(u64);

impl Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 << 8) | u64::from(*b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
    /// A 32-bit fingerprint (`Ghosts`) is spread over all 64 bits: the table reads the top
    /// bits too.
    fn write_u32(&mut self, n: u32) {
        self.0 = u64::from(n).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

type BlockMap<V> = HashMap<BlockHash, V, BuildHasherDefault<IdentityHasher>>;

#[derive(Clone, Debug, Default)]
struct SlotLru {
    ticks: BlockMap<u64>,
    queue: VecDeque<(BlockHash, u64)>,
    /// Entries this endpoint may keep (its KV size, scaled to the global budget).
    capacity: usize,
    /// Its KV size in our blocks, before scaling.
    wanted: usize,
    /// What vLLM's own reports say it keeps of ours (see `on_overpredicted`); `None` until
    /// a report contradicted the index.
    retention: Option<usize>,
    /// The blocks it evicted last, and how many of them were sent to it again.
    ghosts: Ghosts,
    /// Touches so far: each touch of a block takes the next number, its place in the LRU.
    seq: u64,
    /// How deep in the LRU the reuse reaches.
    depth: Depth,
    /// The prompts' first blocks held here (`Root`).
    roots: BlockMap<Root>,
    /// What its live conversations will hold, in entries (`PrefixIndex::projected_held`),
    /// refreshed every `Root::REFRESH` records.
    projected: Option<f64>,
    records: u32,
}

/// A conversation's root in a server's part of the index: the first block of a prompt
/// recorded there, when it was last touched (its place in the LRU) and the longest prompt
/// recorded from it, in blocks. A root evicted is a conversation over (or cut short by the
/// cache): its size is one sample of the size conversations end at (`PrefixIndex::ended`).
#[derive(Clone, Copy, Debug)]
struct Root {
    last: u64,
    blocks: u32,
}

impl Root {
    /// Shorter prompts get no root: they grow nothing worth projecting, and the roots stay
    /// under an eighth of the entries.
    const MIN_BLOCKS: usize = 8;
    const REFRESH: u32 = 16;
}

/// How far back in a server's cache its reuse reaches: for each request that finds part of
/// its prompt held, where the last held block of that part sat between the most recently
/// used end (0) and the oldest content (1), counted in touches (those since its last
/// touch over those the whole content spans). Near 1, what least-recently-used eviction
/// will take first is still asked for (conversations that all go on); well below it, the
/// oldest content is done with (replay, long-chat's 1,024 conversations on 4 H100 + 4 A100
/// at 80% read 0.88–0.96 on the H100s as they filled; the same conversations started at
/// under half the pace fell from 0.89 to 0.7 and below once the first had ended).
/// Averaged over the last 32 requests with a hit; none before 8.
type Depth = RecentMean<32>;

/// The mean size, in blocks, of the last 64 roots evicted across the fleet; none before 8.
type Ended = RecentMean<64>;

/// The mean of the last `SPAN` samples or so (a running mean whose weight stops growing at
/// `SPAN`); none before 8 samples.
#[derive(Clone, Copy, Debug, Default)]
struct RecentMean<const SPAN: u32> {
    mean: f64,
    samples: u32,
}

impl<const SPAN: u32> RecentMean<SPAN> {
    const FIRST: u32 = 8;

    fn add(&mut self, sample: f64) {
        self.samples = (self.samples + 1).min(SPAN);
        self.mean += (sample - self.mean) / f64::from(self.samples);
    }

    fn get(self) -> Option<f64> {
        (self.samples >= Self::FIRST).then_some(self.mean)
    }
}

/// Fingerprints of a server's most recently evicted blocks (as many as half the entries it
/// may hold), and the share of its evictions sent to it again while still listed: reuse
/// its cache was too small to keep. A cache that evicts only prefixes no one asks for
/// again reads near 0 (replay, Mooncake trace on 4 H100 + 4 A100 at 80%: the H100s read
/// 0.00–0.20, mostly under 0.1); one whose conversations outgrow it reads a third and more
/// (long-chat there: 0.25–0.43 once the H100s overflowed; both read with a list as long as
/// the cache). 32 bits of a block's hash are
/// enough to tell a few thousand evicted blocks apart, and keep a listed block at about
/// 26 bytes (`ENTRY_BYTES` counts 16 for each entry of the index).
#[derive(Clone, Debug, Default)]
struct Ghosts {
    at: HashMap<u32, u32, BuildHasherDefault<IdentityHasher>>,
    queue: VecDeque<(u32, u32)>,
    seq: u32,
    /// Evicted blocks and those of them sent again, both halved each time `evicted` passes
    /// the cache's size, so the share follows the last turnovers of the cache.
    evicted: f64,
    returned: f64,
}

impl Ghosts {
    fn fingerprint(block: BlockHash) -> u32 {
        block.0 as u32
    }

    /// Lists `block` as evicted, keeping `size / 2` fingerprints at most.
    fn evicted(&mut self, block: BlockHash, size: usize) {
        let keep = size / 2;
        self.seq = self.seq.wrapping_add(1);
        if keep > 0 {
            let fp = Self::fingerprint(block);
            self.at.insert(fp, self.seq);
            self.queue.push_back((fp, self.seq));
        }
        while self.at.len() > keep {
            let Some((fp, seq)) = self.queue.pop_front() else { break };
            if self.at.get(&fp) == Some(&seq) {
                self.at.remove(&fp);
            }
        }
        if self.queue.len() > 2 * self.at.len() + 64 {
            let at = &self.at;
            self.queue.retain(|(fp, seq)| at.get(fp) == Some(seq));
        }
        self.evicted += 1.0;
        if self.evicted > size.max(1) as f64 {
            self.evicted /= 2.0;
            self.returned /= 2.0;
        }
    }

    /// `block` was sent to this server again: counted if it is listed.
    fn sent_again(&mut self, block: BlockHash) {
        if self.at.remove(&Self::fingerprint(block)).is_some() {
            self.returned += 1.0;
        }
    }

    /// The share of recent evictions sent again; none until an eighth of the cache's size
    /// was evicted.
    fn lost_share(&self, size: usize) -> Option<f64> {
        (self.evicted > 0.0 && self.evicted * 8.0 >= size as f64).then(|| (self.returned / self.evicted).min(1.0))
    }
}

impl SlotLru {
    /// Entries kept at most: the KV-derived capacity, lowered by what vLLM reported.
    fn limit(&self) -> usize {
        self.retention.map_or(self.capacity, |r| r.min(self.capacity))
    }

    /// The tick of the least recently used entry, dropping the stale pairs before it.
    fn oldest(&mut self) -> Option<u64> {
        while let Some((block, tick)) = self.queue.front() {
            if self.ticks.get(block) == Some(tick) {
                return Some(*tick);
            }
            self.queue.pop_front();
        }
        None
    }
}

#[derive(Clone, Debug)]
pub struct PrefixIndex {
    holders: BlockMap<Vec<Slot>>,
    slots: Vec<SlotLru>,
    budget_entries: usize,
    ended: Ended,
}

impl PrefixIndex {
    pub fn new(max_memory_bytes: usize) -> Self {
        Self {
            holders: BlockMap::default(),
            slots: Vec::new(),
            budget_entries: (max_memory_bytes / ENTRY_BYTES).max(1),
            ended: Ended::default(),
        }
    }

    /// Entries held now, across all endpoints.
    pub fn entries(&self) -> usize {
        self.slots.iter().map(|s| s.ticks.len()).sum()
    }

    /// Entries held for `slot` now: how much of the prefix space the index places there.
    pub fn held(&self, slot: Slot) -> usize {
        self.slots.get(usize::from(slot)).map_or(0, |s| s.ticks.len())
    }

    pub fn budget_entries(&self) -> usize {
        self.budget_entries
    }

    /// The share of `slot`'s recent evictions that were sent to it again (`Ghosts`): how
    /// much reuse its cache is too small to keep. None until it evicted an eighth of its
    /// size.
    pub fn lost_share(&self, slot: Slot) -> Option<f64> {
        let s = self.slots.get(usize::from(slot))?;
        s.ghosts.lost_share(s.limit())
    }

    /// How far back in `slot`'s part of the index its recent hits reached, 0 the most
    /// recently used end, 1 its oldest content (`Depth`). None until 8 requests found part
    /// of their prompt there.
    pub fn reuse_depth(&self, slot: Slot) -> Option<f64> {
        self.slots.get(usize::from(slot))?.depth.get()
    }

    /// What `slot`'s live conversations will hold once they have grown, in entries: each
    /// root touched more recently than its hits reach (`reuse_depth`) counted at the larger
    /// of its longest prompt and the size conversations end at across the fleet (`Ended`).
    /// Where conversations go on, a server that took many of them lately holds little now
    /// and much later: a server that joined a fleet while conversations opened drew 172 of
    /// the 381 opened after it by the little it held, and their histories outgrew its cache
    /// (BENCHMARKS, "The slower opening and a join, tried again"). None until 8 roots ended
    /// somewhere and `slot`'s reuse depth is known; refreshed every 16 records.
    pub fn projected_held(&self, slot: Slot) -> Option<f64> {
        self.slots.get(usize::from(slot))?.projected
    }

    /// How full `slot`'s share of the index is (entries held ÷ entries it may hold).
    pub fn fill(&self, slot: Slot) -> f64 {
        self.held(slot) as f64 / self.capacity(slot).max(1) as f64
    }

    /// Entries `slot` may hold now: its share of the budget, lowered by vLLM's reports.
    pub fn capacity(&self, slot: Slot) -> usize {
        self.slots.get(usize::from(slot)).map_or(0, SlotLru::limit)
    }

    /// The server behind `slot` lacked `missing` blocks the index listed for it. It evicts
    /// least recently used first, so what the index holds for it that is older is gone as
    /// well: keep `missing` fewer entries than now (never under an eighth of its capacity,
    /// so one odd report cannot empty it), dropping the oldest.
    pub fn on_overpredicted(&mut self, slot: Slot, missing: usize) {
        let i = usize::from(slot);
        let Some(lru) = self.slots.get_mut(i) else { return };
        let floor = lru.capacity / 8;
        lru.retention = Some(lru.ticks.len().saturating_sub(missing).max(floor));
        self.evict_to_capacity(i);
    }

    /// A report confirmed the index's prediction for `slot`: it may keep `more` entries
    /// (the blocks the request added) again, up to its capacity.
    pub fn on_confirmed(&mut self, slot: Slot, more: usize) {
        let Some(lru) = self.slots.get_mut(usize::from(slot)) else {
            return;
        };
        if let Some(r) = lru.retention {
            let grown = r.saturating_add(more);
            lru.retention = (grown < lru.capacity).then_some(grown);
        }
    }

    /// Changes the memory budget (a process's routers split one budget when they share;
    /// see `Router::set_index_budget`), evicting what no longer fits.
    pub fn set_budget(&mut self, max_memory_bytes: usize) {
        let entries = (max_memory_bytes / ENTRY_BYTES).max(1);
        if entries != self.budget_entries {
            self.budget_entries = entries;
            self.rescale();
        }
    }

    /// Sets how many of our blocks `slot` can hold (0 for a slot being removed), then
    /// rescales every capacity to the budget and evicts what no longer fits.
    pub fn set_capacity(&mut self, slot: Slot, blocks: usize) {
        let i = usize::from(slot);
        if self.slots.len() <= i {
            self.slots.resize_with(i + 1, SlotLru::default);
        }
        if self.slots[i].wanted == blocks {
            return;
        }
        self.slots[i].wanted = blocks;
        self.rescale();
    }

    fn rescale(&mut self) {
        let total: usize = self.slots.iter().map(|s| s.wanted).sum();
        for s in 0..self.slots.len() {
            let wanted = self.slots[s].wanted;
            self.slots[s].capacity = if total <= self.budget_entries {
                wanted
            } else {
                // Proportional share, rounded down, so the sum never exceeds the budget.
                ((wanted as u128 * self.budget_entries as u128) / total as u128) as usize
            };
            self.evict_to_capacity(s);
        }
    }

    /// Forgets everything `slot` held and its capacity.
    pub fn remove(&mut self, slot: Slot) {
        let i = usize::from(slot);
        let Some(lru) = self.slots.get_mut(i) else { return };
        let blocks: Vec<BlockHash> = lru.ticks.keys().copied().collect();
        *lru = SlotLru::default();
        for block in blocks {
            self.drop_holder(block, slot);
        }
        self.set_capacity(slot, 0);
    }

    /// Forgets that `slot` holds `blocks` (a request it refused computed none of them).
    pub fn forget(&mut self, slot: Slot, blocks: &[BlockHash]) {
        let Some(lru) = self.slots.get_mut(usize::from(slot)) else {
            return;
        };
        let gone: Vec<BlockHash> = blocks
            .iter()
            .filter(|b| lru.ticks.remove(b).is_some())
            .copied()
            .collect();
        for block in &gone {
            lru.roots.remove(block);
        }
        for block in gone {
            self.drop_holder(block, slot);
        }
    }

    /// Records that `slot` now holds `blocks` (a request's chained prefix blocks, in order).
    pub fn record(&mut self, slot: Slot, blocks: &[BlockHash]) {
        let i = usize::from(slot);
        if self.slots.get(i).is_none_or(|s| s.limit() == 0) {
            return;
        }
        let (before, oldest) = (self.slots[i].seq, self.slots[i].oldest());
        // The tick the last block of the prompt's held leading run had (`Depth`): read
        // last to first, a block that was not held starts the run again.
        let (mut was, mut after_gap) = (None, true);
        for block in blocks.iter().rev() {
            let lru = &mut self.slots[i];
            lru.seq += 1;
            let tick = lru.seq;
            match lru.ticks.insert(*block, tick) {
                None => {
                    lru.ghosts.sent_again(*block);
                    self.holders.entry(*block).or_default().push(slot);
                    (was, after_gap) = (None, true);
                }
                Some(old) if after_gap => (was, after_gap) = (Some(old), false),
                Some(_) => {}
            }
            lru.queue.push_back((*block, tick));
        }
        if let (Some(was), Some(oldest)) = (was, oldest) {
            self.slots[i]
                .depth
                .add((before - was) as f64 / (before + 1 - oldest) as f64);
        }
        if let Some(root) = blocks.first().filter(|_| blocks.len() >= Root::MIN_BLOCKS) {
            let lru = &mut self.slots[i];
            let seq = lru.seq;
            let entry = lru.roots.entry(*root).or_insert(Root { last: seq, blocks: 0 });
            entry.last = seq;
            entry.blocks = entry.blocks.max(u32::try_from(blocks.len()).unwrap_or(u32::MAX));
        }
        self.evict_to_capacity(i);
        self.slots[i].records += 1;
        if self.slots[i].records >= Root::REFRESH {
            self.slots[i].records = 0;
            self.project(i);
        }
    }

    /// Refreshes `projected_held` for slot `i`.
    fn project(&mut self, i: usize) {
        let ended = self.ended.get();
        let lru = &mut self.slots[i];
        lru.projected = match (ended, lru.depth.get(), lru.oldest()) {
            (Some(ended), Some(depth), Some(oldest)) => {
                let horizon = lru.seq as f64 - depth * (lru.seq + 1 - oldest) as f64;
                let live = lru.roots.values().filter(|r| r.last as f64 >= horizon);
                Some(live.map(|r| f64::from(r.blocks).max(ended)).sum())
            }
            _ => None,
        };
    }

    /// For each slot, how many leading blocks of `blocks` it holds, written to `out[slot]`
    /// (which the caller sizes and zeroes). Stops at the first block no one holds.
    pub fn matches(&self, blocks: &[BlockHash], out: &mut [u32]) {
        let Some(first) = blocks.first().and_then(|b| self.holders.get(b)) else {
            return;
        };
        let mut alive: Vec<Slot> = first.clone();
        for (depth, block) in blocks.iter().enumerate() {
            if depth > 0 {
                let Some(holders) = self.holders.get(block) else { break };
                alive.retain(|s| holders.contains(s));
            }
            if alive.is_empty() {
                break;
            }
            for s in &alive {
                if let Some(slot_out) = out.get_mut(usize::from(*s)) {
                    *slot_out = depth as u32 + 1;
                }
            }
        }
    }

    fn evict_to_capacity(&mut self, i: usize) {
        while self.slots[i].ticks.len() > self.slots[i].limit() {
            let Some((block, tick)) = self.slots[i].queue.pop_front() else {
                break;
            };
            if self.slots[i].ticks.get(&block) == Some(&tick) {
                let lru = &mut self.slots[i];
                lru.ticks.remove(&block);
                if let Some(root) = lru.roots.remove(&block) {
                    self.ended.add(f64::from(root.blocks));
                }
                let lru = &mut self.slots[i];
                let size = lru.limit();
                lru.ghosts.evicted(block, size);
                self.drop_holder(block, i as Slot);
            }
        }
        let lru = &mut self.slots[i];
        if lru.queue.len() > 2 * lru.ticks.len() + 64 {
            let ticks = &lru.ticks;
            lru.queue.retain(|(b, t)| ticks.get(b) == Some(t));
        }
    }

    fn drop_holder(&mut self, block: BlockHash, slot: Slot) {
        if let Some(h) = self.holders.get_mut(&block) {
            h.retain(|s| *s != slot);
            if h.is_empty() {
                self.holders.remove(&block);
            }
        }
    }
}

#[cfg(test)]
mod tests;
