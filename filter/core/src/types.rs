//! Newtypes for the domain values the router passes around, so a token count is never mixed
//! up with a block count, a cost or a timestamp.

use std::fmt;

/// An upstream vLLM server as Envoy addresses it: `ip:port` (or `host:port`).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize)]
pub struct EndpointId(String);

impl EndpointId {
    pub fn new(address: impl Into<String>) -> Self {
        Self(address.into())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for EndpointId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// One prefix block's chained hash, truncated to its first 8 bytes (big-endian).
///
/// The chain itself is computed over full 32-byte SHA-256 digests (see `hashing`); only the
/// stored key is truncated, which keeps the index small. A collision needs 2^32 blocks in
/// the index before it becomes likely, and costs one mis-predicted cache hit, not a failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BlockHash(pub u64);

impl fmt::Display for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// A number of tokens (estimated or exact).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Tokens(pub u64);

impl Tokens {
    pub fn saturating_sub(self, other: Tokens) -> Tokens {
        Tokens(self.0.saturating_sub(other.0))
    }

    pub fn saturating_add(self, other: Tokens) -> Tokens {
        Tokens(self.0.saturating_add(other.0))
    }
}

/// A point in time in milliseconds, from whatever clock the driver uses (host time in Envoy,
/// virtual time in replay). Only differences between two `Millis` mean anything.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize)]
pub struct Millis(pub u64);

impl Millis {
    pub fn since(self, earlier: Millis) -> u64 {
        self.0.saturating_sub(earlier.0)
    }

    pub fn plus(self, ms: u64) -> Millis {
        Millis(self.0.saturating_add(ms))
    }
}

/// A policy's score for one endpoint. For `cost` it is predicted time to first token in
/// milliseconds (lower is better); other policies map their score onto the same "lower wins"
/// scale so one selection routine serves them all.
#[derive(Clone, Copy, Debug, Default, PartialEq, PartialOrd)]
pub struct Cost(pub f64);

impl Cost {
    /// Total order for selection: NaN sorts last so a broken score can never win.
    pub fn total_cmp(&self, other: &Cost) -> std::cmp::Ordering {
        match (self.0.is_nan(), other.0.is_nan()) {
            (true, true) => std::cmp::Ordering::Equal,
            (true, false) => std::cmp::Ordering::Greater,
            (false, true) => std::cmp::Ordering::Less,
            (false, false) => self.0.total_cmp(&other.0),
        }
    }
}
