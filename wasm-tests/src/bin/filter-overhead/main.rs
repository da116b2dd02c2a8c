//! kvroute's cost inside real Envoy, three measurements (`all` runs them in order):
//!
//! - `latency [N]`: one Envoy (envoy/bench-overhead.yaml) with three listeners on the same
//!   route and cluster: no filter, an empty Rust wasm filter, kvroute; in front of fast
//!   fixed-response test servers; one keep-alive client per listener, requests alternating
//!   between them (drift hits every side alike); N measured requests per body size.
//! - `wrk`: the same Envoy under `wrk` (Debian's HTTP load tool) at 1 KiB, 32 KiB and 256 KiB
//!   bodies and several connection counts: requests/s with and without kvroute, their ratio,
//!   and latency p50/p99; then Envoy's resident memory.
//! - `scrape`: Envoy with kvroute polling 4, 64 and 256 simulated servers at the default
//!   intervals and no traffic, the pool learned from Envoy's `/clusters` and as a static
//!   list: CPU of Envoy's main thread (where the scraping service runs) and of the whole
//!   process over 20 s.
//!
//! - `hostile`: the worst bodies we could construct, each just under the filter's 4 MiB
//!   cap, sent one at a time to the listener without a filter and to kvroute's: the time
//!   kvroute adds inside V8 (median and worst of 10) for each.
//!
//! - `sharing`: Envoy CPU per request with the workers sharing one view and without, at 2
//!   and 8 workers; Envoy's memory and idle CPU at 32 workers, both ways.
//!
//! - `presence`: wrk at 1 KiB, 8 connections, on a path kvroute passes through (it only
//!   removes the destination header: no buffering, parsing or routing) and on the inference
//!   path, to split the filter's cost into "being there" and "deciding".
//!
//! - `streams [TOKENS [GAP_US]]`: Envoy CPU per request on streamed and whole answers that
//!   kvroute reads (usage asked for or sent unasked, the Responses API's id and first
//!   output event) and one it leaves unread, against the empty filter.
//!
//! Usage (from the repository root, after `make build-wasm setup-envoy`):
//!   cargo run --release -p kvroute-wasm-tests --bin filter-overhead -- [all|latency [N]|wrk|scrape [interval_ms]]
//!
//! One module per group of measurements (`listeners`, `hostile`, `sharing`, `capture`,
//! `scrape`); `common` and `wrk` hold what they share.

#![allow(clippy::disallowed_methods)] // a wall-time benchmark driver reads the clock

#[cfg(not(target_arch = "wasm32"))]
mod capture;
#[cfg(not(target_arch = "wasm32"))]
mod common;
#[cfg(not(target_arch = "wasm32"))]
mod hostile;
#[cfg(not(target_arch = "wasm32"))]
mod listeners;
#[cfg(not(target_arch = "wasm32"))]
mod scrape;
#[cfg(not(target_arch = "wasm32"))]
mod sharing;
#[cfg(not(target_arch = "wasm32"))]
mod streams;
#[cfg(not(target_arch = "wasm32"))]
mod wrk;

#[cfg(target_arch = "wasm32")]
fn main() {}

#[cfg(not(target_arch = "wasm32"))]
fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if !kvroute_wasm_tests::envoy::repo_root()
        .join("dist/empty-filter.wasm")
        .exists()
    {
        return Err("no dist/empty-filter.wasm (the benchmark's floor): run `make build-wasm-empty`".into());
    }
    match args.first().map(String::as_str).unwrap_or("all") {
        "latency" => listeners::latency(args.get(1).and_then(|a| a.parse().ok()).unwrap_or(2000)),
        "wrk" => listeners::wrk_sweep(),
        "scrape" => scrape::scrape_cost(args.get(1).and_then(|a| a.parse().ok()).unwrap_or(200)),
        "presence" => listeners::presence(),
        "hostile" => hostile::hostile(),
        "sharing" => sharing::sharing(),
        "replicas" => sharing::replicas_cost(
            args.get(1).and_then(|a| a.parse().ok()).unwrap_or(3),
            args.get(2).is_some_and(|a| a == "unique"),
        ),
        "sharing-timed" => sharing::sharing_timed(
            args.get(1).and_then(|a| a.parse().ok()).unwrap_or(3),
            args.get(2).map(String::as_str) != Some("every-decision"),
        ),
        "streams" => streams::streams(
            args.get(1).and_then(|a| a.parse().ok()).unwrap_or(64),
            args.get(2).and_then(|a| a.parse().ok()).unwrap_or(1000),
        ),
        "capture" => capture::capture(args.get(1).and_then(|a| a.parse().ok()).unwrap_or(3)),
        "capture-pair" => capture::capture_pair(args.get(1).and_then(|a| a.parse().ok()).unwrap_or(10)),
        "all" => listeners::latency(2000)
            .and_then(|_| listeners::wrk_sweep())
            .and_then(|_| listeners::presence())
            .and_then(|_| hostile::hostile())
            .and_then(|_| sharing::sharing())
            .and_then(|_| sharing::sharing_timed(3, true))
            .and_then(|_| sharing::replicas_cost(3, false))
            .and_then(|_| capture::capture(3))
            .and_then(|_| capture::capture_pair(10))
            .and_then(|_| streams::streams(64, 1000))
            .and_then(|_| scrape::scrape_cost(200)),
        other => Err(format!(
            "unknown measurement {other:?}: all | latency [N] | wrk | scrape | presence | hostile | sharing | sharing-timed [N [every-decision]] | replicas [N [unique]] | capture [N] | capture-pair [N] | streams [TOKENS [GAP_US]]"
        )),
    }
}
