//! kvroute-sim: a simulator of vLLM servers on GPUs, to test kvroute end to end and to
//! measure routing policies without GPUs.
//!
//! One engine model (`kv`, `engine`, `profile`), two drivers: `replay` runs a fleet in
//! virtual time, deterministically; `serve` runs each server as a real HTTP server in wall
//! time. `workload` turns traces and generators into requests with real prompt text, and
//! `tokens` turns text into the engine's tokens and block hashes. `matrix` and `plan` are
//! built on `replay`: policies × workloads × loads, and the fleet each policy needs.

pub mod bench;
pub mod engine;
pub mod kv;
pub mod matrix;
pub mod overload;
pub mod plan;
pub mod policies;
pub mod profile;
pub mod prom;
pub mod replay;
pub mod report;
pub mod serve;
pub mod tokens;
pub mod workload;
