//! kvroute-core: the routing brain shared by the proxy-wasm filter and the simulator.
//!
//! Pure Rust: no proxy-wasm, no async runtime, no clock, no I/O, no global RNG. Time comes in
//! as a [`Millis`] argument and randomness from the configured seed, so the same events give
//! the same decisions natively, under wasm and in the simulator's virtual time.
//!
//! The flow: [`request::parse`] turns a body into a [`request::ParsedRequest`];
//! [`hashing::PrefixHasher`] turns its canonical text into chained block hashes;
//! [`router::Router::route`] scores the endpoints and returns a [`decision::Decision`] without
//! changing anything; the caller then reports what happened through the router's named events
//! (`on_routed`, `on_completed`, `on_metrics`, `on_scrape_failed`, `on_active_health`,
//! `on_endpoints`, or all the scraping side knows at once: `on_fleet` with a
//! [`fleet::FleetState`]). [`discovery`] learns the pool from Envoy's admin `/clusters`.

pub mod capture;
pub mod config;
pub mod decision;
pub mod discovery;
pub mod endpoint;
pub mod fleet;
pub mod hashing;
pub mod health;
pub mod hold;
pub mod index;
pub mod metrics;
pub mod peer;
pub mod policy;
pub mod prometheus;
pub mod request;
pub mod response;
pub mod router;
pub mod scenario;
pub mod seen;
pub mod speed;
pub mod types;

pub use config::{Config, ConfigError, PolicyKind, RawConfig};
pub use decision::{Decision, EndpointScore, FilterReason, Outcome, Tiering};
pub use fleet::{EnvoyHealth, Fleet, FleetState};
pub use hashing::PrefixHasher;
pub use metrics::{parse_metrics, MetricsError, VllmMetrics};
pub use peer::{PeerEvent, TtftSample};
pub use request::{parse as parse_request, ApiKind, ParsedRequest, RequestError};
pub use router::{Completion, RouteRequest, Router};
pub use types::{BlockHash, Cost, EndpointId, Millis, Tokens};
