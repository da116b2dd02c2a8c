//! The requests in flight, keyed by request key, with how many prefix blocks their records
//! hold between them: a record keeps its prompt's blocks (recorded again where a retry
//! served it), so the records' memory grows with the prompts' length as well as their
//! number, and is bounded by both (`Router::place`).

use std::collections::BTreeMap;

use super::Inflight;

#[derive(Clone, Debug, Default)]
pub(super) struct InflightTable {
    records: BTreeMap<u64, Inflight>,
    blocks: usize,
}

impl InflightTable {
    pub(super) fn len(&self) -> usize {
        self.records.len()
    }

    /// The prefix blocks the records hold between them.
    pub(super) fn blocks(&self) -> usize {
        self.blocks
    }

    pub(super) fn get(&self, key: &u64) -> Option<&Inflight> {
        self.records.get(key)
    }

    /// A record to update in place; its blocks are not to change (they are counted).
    pub(super) fn get_mut(&mut self, key: &u64) -> Option<&mut Inflight> {
        self.records.get_mut(key)
    }

    /// Adds `record` under `key`; returns the record it replaced.
    pub(super) fn insert(&mut self, key: u64, record: Inflight) -> Option<Inflight> {
        self.blocks += record.blocks.len();
        let old = self.records.insert(key, record);
        if let Some(old) = &old {
            self.forget_blocks(old);
        }
        old
    }

    pub(super) fn remove(&mut self, key: &u64) -> Option<Inflight> {
        let old = self.records.remove(key)?;
        self.forget_blocks(&old);
        Some(old)
    }

    fn forget_blocks(&mut self, old: &Inflight) {
        debug_assert!(
            self.blocks >= old.blocks.len(),
            "a record's blocks changed after it was counted"
        );
        self.blocks = self.blocks.saturating_sub(old.blocks.len());
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = (&u64, &Inflight)> {
        self.records.iter()
    }

    pub(super) fn keys(&self) -> impl Iterator<Item = &u64> {
        self.records.keys()
    }

    pub(super) fn values(&self) -> impl Iterator<Item = &Inflight> {
        self.records.values()
    }
}
