//! `latency [N]`, `wrk` and `presence`: one Envoy (envoy/bench-overhead.yaml) with three
//! listeners on the same route and cluster (no filter, an empty Rust wasm filter, kvroute),
//! so the differences between them are the filters' costs, and the empty filter separates
//! what any wasm filter costs from what kvroute adds. `latency` times single requests on
//! keep-alive clients, alternating between the listeners; `wrk` loads each listener in turn
//! at three body sizes and several connection counts; `presence` splits kvroute's cost into
//! being in the chain (a path it passes through) and deciding (the inference path).

use std::time::{Duration, Instant};

use kvroute_wasm_tests::http_client::KeepAlive;

use crate::common::{bench_envoy, body, percentile, rss};
use crate::wrk::{post_script, wrk_abccba};

pub fn latency(requests: usize) -> Result<(), String> {
    let (_servers, envoy) = bench_envoy()?;
    println!("| body | requests | p50 none | p50 empty filter | p50 kvroute | kvroute added p50 | p99 none | p99 empty filter | p99 kvroute | kvroute added p99 |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for size in [1024usize, 32 * 1024, 256 * 1024] {
        let mut clients = [
            KeepAlive::connect(envoy.port2)?,
            KeepAlive::connect(envoy.port3)?,
            KeepAlive::connect(envoy.port)?,
        ];
        let mut times: [Vec<Duration>; 3] = [Vec::new(), Vec::new(), Vec::new()];
        for n in 0..requests + 100 {
            // Distinct prompts (cold prefixes): the filter hashes, scores and routes each one.
            let b = body(size, n);
            for (client, times) in clients.iter_mut().zip(times.iter_mut()) {
                let start = Instant::now();
                let status = client.post("/v1/chat/completions", b.as_bytes())?;
                let took = start.elapsed();
                if status != 200 {
                    return Err(format!("status {status}"));
                }
                if n >= 100 {
                    times.push(took); // the first 100 are warm-up
                }
            }
        }
        for t in &mut times {
            t.sort();
        }
        let [p50n, p50e, p50k] = [0, 1, 2].map(|i| percentile(&times[i], 0.5));
        let [p99n, p99e, p99k] = [0, 1, 2].map(|i| percentile(&times[i], 0.99));
        println!(
            "| {} KiB | {requests} | {p50n:.0} µs | {p50e:.0} µs | {p50k:.0} µs | {:+.0} µs | {p99n:.0} µs | {p99e:.0} µs | {p99k:.0} µs | {:+.0} µs |",
            size / 1024,
            p50k - p50n,
            p99k - p99n
        );
    }
    let routed = envoy.stat("wasmcustom.kvroute.decision.cold") + envoy.stat("wasmcustom.kvroute.decision.prefix_hit");
    println!("\nkvroute routed {routed} requests (decision.cold + decision.prefix_hit).\n");
    Ok(())
}

pub fn wrk_sweep() -> Result<(), String> {
    let (_servers, envoy) = bench_envoy()?;
    let dir = std::env::temp_dir().join(format!("kvroute-wrk-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    println!("Each cell: wrk 4 s per listener in the order none, empty, kvroute, kvroute, empty, none; means of the two runs.\n");
    println!("| body | conns | req/s no filter | req/s empty filter | req/s kvroute | empty/none | kvroute/none | kvroute/empty | p50 none | p50 empty | p50 kvroute | added p50 | p99 none | p99 empty | p99 kvroute | added p99 | Envoy CPU/req none | empty | kvroute |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for size in [1024usize, 32 * 1024, 256 * 1024] {
        let script = post_script(&dir, size)?;
        for connections in [1usize, 8, 32] {
            let [none, empty, with] = wrk_abccba(&envoy, "/v1/chat/completions", &script, connections, 4)?;
            let flag = if with.errors || none.errors || empty.errors {
                " (errors)"
            } else {
                ""
            };
            println!(
                "| {} KiB | {connections} | {:.0} | {:.0} | {:.0} | {:.3} | {:.3}{flag} | {:.3} | {:.0} µs | {:.0} µs | {:.0} µs | {:+.0} µs | {:.0} µs | {:.0} µs | {:.0} µs | {:+.0} µs | {:.0} µs | {:.0} µs | {:.0} µs |",
                size / 1024,
                none.rps,
                empty.rps,
                with.rps,
                empty.rps / none.rps,
                with.rps / none.rps,
                with.rps / empty.rps,
                none.p50_us,
                empty.p50_us,
                with.p50_us,
                with.p50_us - none.p50_us,
                none.p99_us,
                empty.p99_us,
                with.p99_us,
                with.p99_us - none.p99_us,
                none.envoy_cpu_us,
                empty.envoy_cpu_us,
                with.envoy_cpu_us
            );
        }
    }
    let rss = rss(envoy.pid());
    let routed = envoy.stat("wasmcustom.kvroute.decision.cold") + envoy.stat("wasmcustom.kvroute.decision.prefix_hit");
    println!("\nEnvoy (--concurrency 2) resident memory after the sweep: {rss}; kvroute routed {routed} requests.\n");
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

pub fn presence() -> Result<(), String> {
    let (_servers, envoy) = bench_envoy()?;
    let dir = std::env::temp_dir().join(format!("kvroute-presence-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let script = post_script(&dir, 1024)?;
    println!("| path (1 KiB POST, 8 connections) | req/s no filter | req/s empty filter | req/s kvroute | empty/none | kvroute/none | kvroute/empty | Envoy CPU/req none | empty | kvroute |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for (label, path) in [
        ("pass-through (/v1/unknown, answered 404)", "/v1/unknown"),
        ("inference (/v1/chat/completions)", "/v1/chat/completions"),
    ] {
        let [none, empty, with] = wrk_abccba(&envoy, path, &script, 8, 4)?;
        println!(
            "| {label} | {:.0} | {:.0} | {:.0} | {:.3} | {:.3} | {:.3} | {:.1} µs | {:.1} µs | {:.1} µs |",
            none.rps,
            empty.rps,
            with.rps,
            empty.rps / none.rps,
            with.rps / none.rps,
            with.rps / empty.rps,
            none.envoy_cpu_us,
            empty.envoy_cpu_us,
            with.envoy_cpu_us
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
