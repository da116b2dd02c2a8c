//! The filter's added latency in real Envoy: one Envoy (envoy/bench-overhead.yaml) with
//! two listeners on the same route and cluster, one with kvroute and one without, in front
//! of fast fixed-response test servers. One keep-alive client alternates requests between
//! the two listeners, so drift hits both sides alike. Prints a Markdown table.
//!
//! Usage (from the repository root, after `make build-wasm setup-envoy`):
//!   cargo run --release -p kvroute-wasm-tests --bin filter-overhead -- [requests per cell]

#![allow(clippy::disallowed_methods)] // a wall-time benchmark driver reads the clock

#[cfg(target_arch = "wasm32")]
fn main() {}

#[cfg(not(target_arch = "wasm32"))]
fn main() -> Result<(), String> {
    native::main()
}

#[cfg(not(target_arch = "wasm32"))]
mod native {
    use std::time::{Duration, Instant};

    use kvroute_wasm_tests::envoy::Envoy;
    use kvroute_wasm_tests::fake_vllm::{FakeVllm, Load, MODEL};
    use kvroute_wasm_tests::http_client::KeepAlive;

    fn body(bytes: usize, n: usize) -> String {
        let head = format!(r#"{{"model":"{MODEL}","max_tokens":8,"messages":[{{"role":"user","content":""#);
        let tail = format!(r#" request {n}"}}]}}"#);
        let fill = bytes.saturating_sub(head.len() + tail.len());
        format!("{head}{}{tail}", "a".repeat(fill))
    }

    fn percentile(sorted: &[Duration], p: f64) -> f64 {
        let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
        sorted[i].as_secs_f64() * 1e6
    }

    pub fn main() -> Result<(), String> {
        let requests: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(2000);
        let servers: Vec<FakeVllm> = (0..4)
            .map(|_| FakeVllm::start(Load::idle()))
            .collect::<Result<_, _>>()
            .map_err(|e| e.to_string())?;
        let ports: Vec<u16> = servers.iter().map(|s| s.port).collect();
        let envoy = Envoy::start("bench-overhead.yaml", &ports, |t| t)?;
        std::thread::sleep(Duration::from_millis(600)); // a few scrapes reach the workers
        println!(
            "| body | requests | p50 without | p50 with kvroute | added p50 | p99 without | p99 with kvroute | added p99 |"
        );
        println!("|---|---|---|---|---|---|---|---|");
        for size in [1024usize, 32 * 1024] {
            let (mut with, mut without) = (KeepAlive::connect(envoy.port)?, KeepAlive::connect(envoy.port2)?);
            let (mut t_with, mut t_without) = (Vec::with_capacity(requests), Vec::with_capacity(requests));
            for n in 0..requests + 100 {
                // Distinct prompts (cold prefixes): the filter hashes, scores and routes each one.
                let b = body(size, n);
                for (client, times) in [(&mut with, &mut t_with), (&mut without, &mut t_without)] {
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
            t_with.sort();
            t_without.sort();
            let (p50w, p50o) = (percentile(&t_with, 0.5), percentile(&t_without, 0.5));
            let (p99w, p99o) = (percentile(&t_with, 0.99), percentile(&t_without, 0.99));
            println!(
                "| {} KiB | {requests} | {p50o:.0} µs | {p50w:.0} µs | {:+.0} µs | {p99o:.0} µs | {p99w:.0} µs | {:+.0} µs |",
                size / 1024,
                p50w - p50o,
                p99w - p99o
            );
        }
        let hits =
            envoy.stat("wasmcustom.kvroute.decision.cold") + envoy.stat("wasmcustom.kvroute.decision.prefix_hit");
        println!("\nkvroute routed {hits} requests (decision.cold + decision.prefix_hit).");
        Ok(())
    }
}
