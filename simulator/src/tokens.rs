//! Text → the engine's tokens (documented deterministic rule).
//!
//! A prompt is the request's canonical text (`kvroute_core::request`, the same bytes the
//! filter hashes) at 4 bytes per token, so a shared text prefix is a shared token prefix.
//! The engine's 16-token blocks are 64-byte runs of that text, chained with FNV-1a-64 like
//! vLLM chains its block hashes. Token-id prompts are 4 bytes per id, so they count exactly.
//!
//! Workload text is built from segments `(seed, tokens)`: token `i` of a segment is 3
//! lowercase letters and a space derived from `mix(seed, i)`, so every token is exactly 4
//! bytes, JSON-safe, and a segment's first `k` tokens are the same whatever its length.

use kvroute_core::request::BYTES_PER_TOKEN;

use crate::profile::BLOCK_TOKENS;

const BLOCK_BYTES: usize = (BLOCK_TOKENS * BYTES_PER_TOKEN) as usize;

/// Prompt tokens and the chained hashes of the full 16-token blocks of `canonical`.
pub fn engine_blocks(canonical: &[u8], prompt_tokens: u64) -> Vec<u64> {
    let full = (prompt_tokens / BLOCK_TOKENS) as usize;
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    canonical
        .chunks_exact(BLOCK_BYTES)
        .take(full)
        .map(|block| {
            for b in block {
                h = (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3);
            }
            h = kvroute_core::policy::mix(h);
            h
        })
        .collect()
}

/// A run of deterministic text: `tokens` tokens of seed `seed`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    pub seed: u64,
    pub tokens: u64,
}

impl Segment {
    pub fn new(seed: u64, tokens: u64) -> Segment {
        Segment { seed, tokens }
    }

    pub fn write(&self, out: &mut String) {
        out.reserve(self.tokens as usize * 4);
        for i in 0..self.tokens {
            let r = kvroute_core::policy::mix(self.seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ i);
            for k in 0..3 {
                out.push(char::from(b'a' + ((r >> (8 * k)) % 26) as u8));
            }
            out.push(' ');
        }
    }
}

/// Renders segments into one text.
pub fn render(segments: &[Segment]) -> String {
    let mut out = String::new();
    for s in segments {
        s.write(&mut out);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_are_four_bytes_a_token_and_prefix_stable() {
        let long = render(&[Segment::new(5, 100)]);
        let short = render(&[Segment::new(5, 40)]);
        assert_eq!(long.len(), 400);
        assert!(long.starts_with(&short));
        assert_ne!(render(&[Segment::new(6, 40)]), short);
    }

    #[test]
    fn shared_text_gives_shared_engine_blocks() {
        let a = render(&[Segment::new(1, 64), Segment::new(2, 64)]);
        let b = render(&[Segment::new(1, 64), Segment::new(3, 64)]);
        let (ha, hb) = (engine_blocks(a.as_bytes(), 128), engine_blocks(b.as_bytes(), 128));
        assert_eq!(ha.len(), 8);
        assert_eq!(ha[..4], hb[..4]);
        assert_ne!(ha[4], hb[4]);
        assert_ne!(ha[5], hb[5]);
    }
}
