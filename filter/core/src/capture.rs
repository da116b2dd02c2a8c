//! Traffic capture: one JSON line per routed request, without its text, in the format
//! `kvroute-sim replay --format capture` reads (a superset of Mooncake's trace lines).
//!
//! A line holds the arrival time, the model, the prompt's prefix block ids, prompt and
//! output token counts (from the response's `usage` when it came, else estimates), the
//! server that answered, the cached tokens it reported and the status. The filter hands the
//! line to Envoy as filter state and an access log writes it (envoy/capture/README.md): no
//! file, socket or buffer of kvroute's own.
//!
//! Block ids. The router already hashes the prompt into chained SHA-256 blocks keyed by
//! model, tenant and cache salt (`hashing`). A capture id is the first 53 bits of
//! SipHash-2-4_K(h), where h is the chain hash at the end of a capture block and the 128-bit
//! key K is derived from the deployment's secret salt (SHA-256, once): equal ids mean equal
//! prefixes (the chain carries everything before), so a replay sees the traffic's sharing;
//! without the salt nobody can test a guessed prompt against the trace, and traces of two
//! deployments cannot be joined. SipHash is a keyed pseudo-random function made for short
//! inputs: a few dozen additions and rotations per id, where a keyed SHA-256 compression
//! (the first version) costs far more in V8, which has no SHA instructions. 53 bits keep ids
//! exact in every JSON reader; a collision needs about 10⁸ distinct blocks.
//!
//! Sampling keeps whole prefix families: a request is in when a hash of its first block
//! (salted) falls under the rate, so every request sharing that first block is in or out
//! together and the sampled trace keeps its sharing intact. A prompt shorter than one block
//! is sampled on its request number.

use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::config::RawCapture;
use crate::policy::mix;
use crate::request::BYTES_PER_TOKEN;
use crate::types::BlockHash;

/// Tags the key derivation so a capture salt never doubles as anything else.
const KEY_TAG: &[u8] = b"kvroute-capture-v1";
const ID_MASK: u64 = (1 << 53) - 1;

/// The capture side of a validated configuration; absent when capture is off.
#[derive(Clone, Debug)]
pub struct Capturer {
    /// SipHash's key, from the salt.
    key: (u64, u64),
    /// Routing blocks per capture block.
    stride: usize,
    block_tokens: u64,
    /// A request is captured when its sampling key is at most this.
    threshold: u64,
    sample_seed: u64,
    property: String,
}

impl Capturer {
    /// `routing_block_bytes` is `hashing.block_bytes`; the config has checked that the
    /// capture block is a multiple of it and that a salt is set.
    pub fn new(c: &RawCapture, routing_block_bytes: usize) -> Option<Capturer> {
        if c.sample <= 0.0 {
            return None;
        }
        let block_bytes = if c.block_bytes == 0 {
            routing_block_bytes
        } else {
            c.block_bytes
        };
        let derived: [u8; 32] = Sha256::new()
            .chain_update(KEY_TAG)
            .chain_update([0u8])
            .chain_update(c.salt.as_bytes())
            .finalize()
            .into();
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&derived[i * 8..i * 8 + 8]);
            u64::from_le_bytes(w)
        };
        Some(Capturer {
            key: (word(0), word(1)),
            stride: (block_bytes / routing_block_bytes.max(1)).max(1),
            block_tokens: (block_bytes as u64 / BYTES_PER_TOKEN).max(1),
            threshold: threshold(c.sample),
            sample_seed: word(2),
            property: c.property.clone(),
        })
    }

    /// The filter state name the line goes to (`wasm.<property>` in Envoy).
    pub fn property(&self) -> &str {
        &self.property
    }

    pub fn block_tokens(&self) -> u64 {
        self.block_tokens
    }

    /// Whether a request with these routing blocks (request number `n` when it has none) is
    /// in the sample.
    pub fn sampled(&self, blocks: &[BlockHash], n: u64) -> bool {
        let key = blocks.first().map_or(n.wrapping_mul(0x9e37_79b9_7f4a_7c15), |b| b.0);
        mix(key ^ self.sample_seed) <= self.threshold
    }

    /// The capture ids of the full capture blocks among `blocks`.
    pub fn ids(&self, blocks: &[BlockHash]) -> Vec<u64> {
        blocks
            .iter()
            .skip(self.stride - 1)
            .step_by(self.stride)
            .map(|h| siphash24(self.key, h.0) & ID_MASK)
            .collect()
    }
}

/// SipHash-2-4 (Aumasson and Bernstein, 2012) of one 8-byte message, `m` taken as its
/// little-endian bytes.
fn siphash24((k0, k1): (u64, u64), m: u64) -> u64 {
    let mut v = [
        k0 ^ 0x736f_6d65_7073_6575,
        k1 ^ 0x646f_7261_6e64_6f6d,
        k0 ^ 0x6c79_6765_6e65_7261,
        k1 ^ 0x7465_6462_7974_6573,
    ];
    let round = |v: &mut [u64; 4]| {
        v[0] = v[0].wrapping_add(v[1]);
        v[1] = v[1].rotate_left(13) ^ v[0];
        v[0] = v[0].rotate_left(32);
        v[2] = v[2].wrapping_add(v[3]);
        v[3] = v[3].rotate_left(16) ^ v[2];
        v[0] = v[0].wrapping_add(v[3]);
        v[3] = v[3].rotate_left(21) ^ v[0];
        v[2] = v[2].wrapping_add(v[1]);
        v[1] = v[1].rotate_left(17) ^ v[2];
        v[2] = v[2].rotate_left(32);
    };
    // The message word, then the final word: the length (8) in the top byte, no tail bytes.
    for word in [m, 8u64 << 56] {
        v[3] ^= word;
        round(&mut v);
        round(&mut v);
        v[0] ^= word;
    }
    v[2] ^= 0xff;
    for _ in 0..4 {
        round(&mut v);
    }
    v[0] ^ v[1] ^ v[2] ^ v[3]
}

fn threshold(rate: f64) -> u64 {
    if rate >= 1.0 {
        u64::MAX
    } else {
        // Exact enough: a rate is a fraction, not a count.
        (rate * u64::MAX as f64) as u64
    }
}

/// One captured request, written as one JSON line.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CaptureLine<'a> {
    /// Arrival at the gateway, ms since the Unix epoch.
    pub timestamp: u64,
    pub model: &'a str,
    /// Prompt tokens: `usage.prompt_tokens`, else the 4-bytes-per-token estimate.
    pub input_length: u64,
    /// Output tokens: `usage.completion_tokens`, else the request's `max_tokens`, else 0.
    pub output_length: u64,
    /// Whether the two lengths came from the server's `usage`.
    pub usage: bool,
    pub hash_ids: &'a [u64],
    /// Prompt tokens per hash id (the capture block at 4 bytes per token).
    pub block_tokens: u64,
    /// The server that answered (`ip:port`), when one did.
    pub server: Option<&'a str>,
    /// `usage.prompt_tokens_details.cached_tokens`, when reported.
    pub cached_tokens: Option<u64>,
    /// The response status; 0 when none came (client gone, upstream reset).
    pub status: u16,
}

impl CaptureLine<'_> {
    pub fn to_json(&self) -> String {
        // Serialising plain fields cannot fail; an empty line is skipped by every reader.
        serde_json::to_string(self).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn capturer(sample: f64, block_bytes: usize, salt: &str) -> Capturer {
        let c = RawCapture {
            sample,
            block_bytes,
            salt: salt.into(),
            ..RawCapture::default()
        };
        Capturer::new(&c, 256).unwrap()
    }

    fn blocks(seeds: &[u64]) -> Vec<BlockHash> {
        seeds.iter().map(|s| BlockHash(mix(*s))).collect()
    }

    #[test]
    fn siphash_matches_the_reference_vector() {
        // The reference implementation's test key 00 01 … 0f and the 8-byte message 00 01 … 07
        // (vectors.h of the SipHash paper's code, entry 8).
        let k0 = u64::from_le_bytes([0, 1, 2, 3, 4, 5, 6, 7]);
        let k1 = u64::from_le_bytes([8, 9, 10, 11, 12, 13, 14, 15]);
        let m = u64::from_le_bytes([0, 1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(
            siphash24((k0, k1), m).to_le_bytes(),
            [0x62, 0x24, 0x93, 0x9a, 0x79, 0xf5, 0xf5, 0x93]
        );
    }

    #[test]
    fn off_unless_sampling() {
        assert!(Capturer::new(&RawCapture::default(), 256).is_none());
    }

    #[test]
    fn equal_prefixes_give_equal_ids_and_the_salt_changes_them_all() {
        let a = capturer(1.0, 0, "salt-one-0123456");
        let b = capturer(1.0, 0, "salt-two-0123456");
        let x = a.ids(&blocks(&[1, 2, 3]));
        let y = a.ids(&blocks(&[1, 2, 4]));
        assert_eq!(x.len(), 3);
        assert_eq!(x[..2], y[..2]);
        assert_ne!(x[2], y[2]);
        let z = b.ids(&blocks(&[1, 2, 3]));
        assert!(x.iter().zip(&z).all(|(p, q)| p != q), "another salt shares no id");
        assert!(x.iter().all(|id| *id <= ID_MASK));
    }

    #[test]
    fn a_coarser_capture_block_takes_the_chain_hash_at_its_end() {
        let fine = capturer(1.0, 256, "0123456789abcdef");
        let coarse = capturer(1.0, 1024, "0123456789abcdef");
        let b = blocks(&[1, 2, 3, 4, 5, 6, 7, 8, 9]);
        let ids = coarse.ids(&b);
        assert_eq!(ids, vec![fine.ids(&b)[3], fine.ids(&b)[7]], "full 4-block runs only");
        assert_eq!(coarse.block_tokens(), 256);
        assert_eq!(fine.block_tokens(), 64);
    }

    #[test]
    fn sampling_keeps_prefix_families_whole_and_follows_the_rate() {
        let c = capturer(0.25, 0, "0123456789abcdef");
        let mut kept = 0;
        for family in 0..4000u64 {
            let first = blocks(&[family, 1]);
            let other = blocks(&[family, 2, 3]);
            assert_eq!(c.sampled(&first, 0), c.sampled(&other, 99), "family {family} split");
            kept += u32::from(c.sampled(&first, 0));
        }
        assert!((800..1200).contains(&kept), "kept {kept} of 4000 at 25%");
        let all = capturer(1.0, 0, "0123456789abcdef");
        assert!((0..1000).all(|n| all.sampled(&[], n)));
    }

    #[test]
    fn a_line_is_one_json_object_with_every_field() {
        let ids = [7u64, 9];
        let line = CaptureLine {
            timestamp: 1_795_000_000_123,
            model: "m\"x",
            input_length: 300,
            output_length: 12,
            usage: true,
            hash_ids: &ids,
            block_tokens: 64,
            server: Some("10.0.0.1:8000"),
            cached_tokens: None,
            status: 200,
        }
        .to_json();
        assert!(!line.contains('\n'));
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["model"], "m\"x");
        assert_eq!(v["hash_ids"], serde_json::json!([7, 9]));
        assert_eq!(v["cached_tokens"], serde_json::Value::Null);
        assert_eq!(v["server"], "10.0.0.1:8000");
        assert_eq!(v["timestamp"], 1_795_000_000_123u64);
    }
}
