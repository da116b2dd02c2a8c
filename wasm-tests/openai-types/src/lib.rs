//! Dev-only crate: its tests (`tests/responses.rs`) drive a live `kvroute-sim serve` and
//! deserialize every response with the `async-openai` types. Nothing here is shipped.
