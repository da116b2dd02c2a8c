//! kvroute's artifact tests. `tests/core_on_wasm.rs` runs the routing core compiled to
//! `wasm32-unknown-unknown` under node (`make test-wasm`) and checks it computes exactly
//! what the native build recorded in `filter/core/tests/fixtures/`.
