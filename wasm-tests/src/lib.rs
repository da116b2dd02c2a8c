//! kvroute's artifact tests.
//!
//! - `tests/core_on_wasm.rs` runs the routing core compiled to `wasm32-unknown-unknown`
//!   under node (`make test-wasm`) and checks it computes exactly what the native build
//!   recorded in `filter/core/tests/fixtures/`.
//! - `tests/e2e.rs` drives real Envoy with `dist/kvroute.wasm` in front of test vLLM
//!   servers on loopback (`make test-e2e`).
//!
//! This library holds the test doubles and harness those tests share.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test support code
#![allow(clippy::disallowed_methods)] // a wall-time test driver: reading the clock is its job

#[cfg(not(target_arch = "wasm32"))]
pub mod envoy;
#[cfg(not(target_arch = "wasm32"))]
pub mod fake_vllm;
#[cfg(not(target_arch = "wasm32"))]
pub mod http_client;
#[cfg(not(target_arch = "wasm32"))]
pub mod soak;
