//! The log's wire format: a segment and its events as protobuf (`prost`), and the
//! conversion from and to `kvroute_core::PeerEvent`.

use kvroute_core::{BlockHash, EndpointId, Millis, PeerEvent, Tokens, TtftSample};

/// One segment of the process's log, as it sits in shared data.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Segment {
    #[prost(uint64, tag = "1")]
    pub number: u64,
    #[prost(uint32, tag = "2")]
    pub origin: u32,
    #[prost(uint64, tag = "3")]
    pub nonce: u64,
    #[prost(uint64, tag = "4")]
    pub written_ms: u64,
    #[prost(message, repeated, tag = "5")]
    pub events: Vec<WireEvent>,
    /// The worker that wrote it POSTed it to the other replicas itself
    /// (`share.replicas.from_workers`): the scraping service does not forward it again.
    #[prost(bool, tag = "6")]
    pub sent: bool,
}

const ROUTED: u32 = 0;
const FIRST_TOKEN: u32 = 1;
const COMPLETED: u32 = 2;
const STORED: u32 = 3;

#[derive(Clone, PartialEq, prost::Message)]
pub struct WireEvent {
    #[prost(uint64, tag = "1")]
    pub key: u64,
    #[prost(uint32, tag = "2")]
    pub kind: u32,
    #[prost(string, tag = "3")]
    pub endpoint: String,
    #[prost(fixed64, repeated, tag = "4")]
    pub blocks: Vec<u64>,
    #[prost(uint64, tag = "5")]
    pub prompt_tokens: u64,
    #[prost(uint64, tag = "6")]
    pub uncached: u64,
    #[prost(uint64, tag = "7")]
    pub at_ms: u64,
    #[prost(uint64, optional, tag = "8")]
    pub cached_tokens: Option<u64>,
    /// A first token's time and its router's prediction (`TtftSample`), both or neither.
    #[prost(uint32, optional, tag = "9")]
    pub ttft_predicted_ms: Option<u32>,
    #[prost(uint32, optional, tag = "10")]
    pub ttft_observed_ms: Option<u32>,
    /// A stored response's key (`request::response_key`), for `STORED`.
    #[prost(fixed64, tag = "11")]
    pub response: u64,
}

impl From<&PeerEvent> for WireEvent {
    fn from(e: &PeerEvent) -> WireEvent {
        let mut w = WireEvent {
            key: e.key(),
            ..WireEvent::default()
        };
        match e {
            PeerEvent::Routed {
                endpoint,
                blocks,
                prompt_tokens,
                uncached,
                at,
                ..
            } => {
                w.kind = ROUTED;
                w.endpoint = endpoint.to_string();
                w.blocks = blocks.iter().map(|b| b.0).collect();
                (w.prompt_tokens, w.uncached, w.at_ms) = (prompt_tokens.0, uncached.0, at.0);
            }
            PeerEvent::FirstToken { ttft, .. } => {
                w.kind = FIRST_TOKEN;
                w.ttft_predicted_ms = ttft.map(|s| s.predicted_ms);
                w.ttft_observed_ms = ttft.map(|s| s.observed_ms);
            }
            PeerEvent::Completed {
                served_by,
                cached_tokens,
                ..
            } => {
                w.kind = COMPLETED;
                w.endpoint = served_by.as_ref().map(ToString::to_string).unwrap_or_default();
                w.cached_tokens = *cached_tokens;
            }
            PeerEvent::Stored { response, endpoint, .. } => {
                w.kind = STORED;
                w.endpoint = endpoint.to_string();
                w.response = *response;
            }
        }
        w
    }
}

impl Segment {
    /// Whether it carries a placement (a request routed, a response stored), not only first
    /// tokens and completions.
    pub fn holds_placement(&self) -> bool {
        self.events.iter().any(|e| e.kind == ROUTED || e.kind == STORED)
    }
}

impl WireEvent {
    pub(super) fn into_event(self) -> Option<PeerEvent> {
        let key = self.key;
        match self.kind {
            ROUTED => Some(PeerEvent::Routed {
                key,
                endpoint: EndpointId::new(self.endpoint),
                blocks: self.blocks.into_iter().map(BlockHash).collect(),
                prompt_tokens: Tokens(self.prompt_tokens),
                uncached: Tokens(self.uncached),
                at: Millis(self.at_ms),
            }),
            FIRST_TOKEN => Some(PeerEvent::FirstToken {
                key,
                ttft: match (self.ttft_predicted_ms, self.ttft_observed_ms) {
                    (Some(predicted_ms), Some(observed_ms)) => Some(TtftSample {
                        predicted_ms,
                        observed_ms,
                    }),
                    _ => None,
                },
            }),
            COMPLETED => Some(PeerEvent::Completed {
                key,
                served_by: (!self.endpoint.is_empty()).then(|| EndpointId::new(self.endpoint)),
                cached_tokens: self.cached_tokens,
            }),
            STORED => Some(PeerEvent::Stored {
                key,
                response: self.response,
                endpoint: EndpointId::new(self.endpoint),
            }),
            _ => None,
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use prost::Message;

    pub(in crate::mesh) fn routed(key: u64) -> PeerEvent {
        PeerEvent::Routed {
            key,
            endpoint: EndpointId::new("10.0.0.1:8000"),
            blocks: vec![BlockHash(1), BlockHash(u64::MAX)],
            prompt_tokens: Tokens(300),
            uncached: Tokens(44),
            at: Millis(1234),
        }
    }

    #[test]
    fn every_event_kind_survives_the_wire() {
        let events = vec![
            routed(7),
            PeerEvent::FirstToken { key: 7, ttft: None },
            PeerEvent::FirstToken {
                key: 7,
                ttft: Some(TtftSample {
                    predicted_ms: 120,
                    observed_ms: 360,
                }),
            },
            PeerEvent::Completed {
                key: 7,
                served_by: Some(EndpointId::new("10.0.0.2:8000")),
                cached_tokens: Some(256),
            },
            PeerEvent::Completed {
                key: 8,
                served_by: None,
                cached_tokens: None,
            },
            PeerEvent::Stored {
                key: 9,
                response: u64::MAX - 3,
                endpoint: EndpointId::new("10.0.0.3:8000"),
            },
        ];
        for e in events {
            let bytes = WireEvent::from(&e).encode_to_vec();
            assert_eq!(WireEvent::decode(bytes.as_slice()).unwrap().into_event(), Some(e));
        }
    }

    #[test]
    fn a_segment_survives_the_wire() {
        let s = Segment {
            number: 3,
            origin: 2,
            nonce: 5,
            written_ms: 0,
            events: [routed(1), PeerEvent::FirstToken { key: 1, ttft: None }]
                .iter()
                .map(WireEvent::from)
                .collect(),
            sent: true,
        };
        assert!(s.holds_placement());
        assert_eq!(Segment::decode(s.encode_to_vec().as_slice()).unwrap(), s);
    }

    #[test]
    fn an_event_of_an_unknown_kind_is_dropped() {
        // A newer worker's event kind, read by an older one during a rolling update.
        let mut e = WireEvent::from(&routed(7));
        e.kind = 9;
        let bytes = e.encode_to_vec();
        assert_eq!(WireEvent::decode(bytes.as_slice()).unwrap().into_event(), None);
    }
}
