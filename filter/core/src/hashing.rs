//! Prefix block hashing: the spec both the filter and the simulator implement.
//!
//! root = SHA-256("kvroute-prefix-v1" 0x00 model 0x00 tenant 0x00 cache_salt)
//! h_i  = SHA-256(h_{i-1} ‖ block_i), where block_i is the i-th run of `block_bytes` bytes
//!        of the canonical text (see `request`), full blocks only, at most `max_blocks`.
//! The stored [`BlockHash`] is the first 8 bytes of h_i, big-endian.
//!
//! Chaining makes a block's hash depend on everything before it, like vLLM's own prefix
//! cache, so equal hashes mean equal prefixes. The root separates models, tenants and cache
//! salts: two tenants with the same prompt never share affinity. Golden vectors produced by
//! an independent Python implementation live in `tests/fixtures/prefix_hash_golden.json`.

use sha2::{Digest, Sha256};

use crate::types::BlockHash;

pub const VERSION_TAG: &[u8] = b"kvroute-prefix-v1";

/// Cuts canonical text into chained block hashes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefixHasher {
    block_bytes: usize,
    max_blocks: usize,
}

impl PrefixHasher {
    /// `block_bytes` and `max_blocks` must be at least 1 (the config guarantees it).
    pub fn new(block_bytes: usize, max_blocks: usize) -> Self {
        debug_assert!(
            block_bytes > 0 && max_blocks > 0,
            "block_bytes and max_blocks must be positive"
        );
        Self {
            block_bytes: block_bytes.max(1),
            max_blocks: max_blocks.max(1),
        }
    }

    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// The chained hashes of the full blocks of `canonical`.
    pub fn hash(&self, model: &str, tenant: &str, cache_salt: &str, canonical: &[u8]) -> Vec<BlockHash> {
        let mut chain = root(model, tenant, cache_salt);
        canonical
            .chunks_exact(self.block_bytes)
            .take(self.max_blocks)
            .map(|block| {
                let mut h = Sha256::new();
                h.update(chain);
                h.update(block);
                chain = h.finalize().into();
                BlockHash(u64::from_be_bytes([
                    chain[0], chain[1], chain[2], chain[3], chain[4], chain[5], chain[6], chain[7],
                ]))
            })
            .collect()
    }
}

fn root(model: &str, tenant: &str, cache_salt: &str) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(VERSION_TAG);
    for part in [model, tenant, cache_salt] {
        h.update([0u8]);
        h.update(part.as_bytes());
    }
    h.finalize().into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_full_blocks_are_hashed_and_the_cap_holds() {
        let h = PrefixHasher::new(4, 3);
        assert_eq!(h.hash("m", "", "", b"abc").len(), 0);
        assert_eq!(h.hash("m", "", "", b"abcdefg").len(), 1);
        assert_eq!(h.hash("m", "", "", &[7u8; 100]).len(), 3);
    }

    #[test]
    fn a_shared_prefix_gives_shared_leading_hashes_and_then_diverges() {
        let h = PrefixHasher::new(4, 16);
        let a = h.hash("m", "t", "", b"aaaabbbbccccdddd");
        let b = h.hash("m", "t", "", b"aaaabbbbXcccdddd");
        assert_eq!(a[..2], b[..2]);
        assert_ne!(a[2], b[2]);
        assert_ne!(a[3], b[3], "the chain carries the difference forward");
    }

    #[test]
    fn model_tenant_and_salt_separate_the_chains() {
        let h = PrefixHasher::new(4, 4);
        let base = h.hash("m", "t", "", b"abcd");
        assert_ne!(base, h.hash("m2", "t", "", b"abcd"));
        assert_ne!(base, h.hash("m", "t2", "", b"abcd"));
        assert_ne!(base, h.hash("m", "t", "s", b"abcd"));
        // The separator keeps field boundaries: ("ab","c") differs from ("a","bc").
        assert_ne!(h.hash("ab", "c", "", b"abcd"), h.hash("a", "bc", "", b"abcd"));
    }
}
