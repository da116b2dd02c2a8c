//! The soak: steady traffic through real Envoy + kvroute + the simulated fleet for a while,
//! checking that nothing fails and nothing grows. Used by the 60-second test in `make test`
//! and by `cargo run --release -p kvroute-wasm-tests --bin soak -- SECONDS`.

use std::time::Duration;

use kvroute_sim::bench::Api;
use kvroute_sim::profile::{Gpu, Model, Profile};
use kvroute_sim::workload::{generate, GenParams, Generator};

use crate::envoy::Envoy;

#[derive(Debug)]
pub struct SoakReport {
    pub seconds: u64,
    pub requests: usize,
    pub completed: usize,
    pub failed: usize,
    pub prefix_hit_rate: f64,
    /// Envoy's resident memory after the warm-up and at the end, in KiB.
    pub rss_after_warmup_kib: u64,
    pub rss_end_kib: u64,
    pub index_entries: u64,
    pub inflight_at_end: u64,
    /// (seconds into the measured phase, Envoy RSS in KiB, kvroute index entries), about 30
    /// samples evenly spread: the trend, not only the two ends.
    pub samples: Vec<(u64, u64, u64)>,
}

impl SoakReport {
    pub fn rss_growth(&self) -> f64 {
        self.rss_end_kib as f64 / self.rss_after_warmup_kib.max(1) as f64 - 1.0
    }
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// `seconds` of traffic at `rate` requests/s after a warm-up of a quarter of that time
/// (at most 5 minutes); 4 simulated servers at 20× real time.
pub fn soak(seconds: u64, rate: f64) -> Result<SoakReport, String> {
    let profile = Profile::new(Gpu::H100_80g, Model::Llama31_8b, 1).map_err(|e| e.to_string())?;
    let (rt, base) = kvroute_sim::serve::start_in_background(profile, 4, 20.0).map_err(|e| e.to_string())?;
    let ports: Vec<u16> = (base..base + 4).collect();
    let envoy = Envoy::start("envoy.yaml", &ports, |t| t)?;
    std::thread::sleep(Duration::from_millis(800));
    let url = format!("http://127.0.0.1:{}", envoy.port);
    let phase = |secs: u64, seed: u64| {
        // Enough prompts for the phase; groups repeat, so the prefix index fills and ages.
        let count = (secs as f64 * rate).ceil() as u64 + 16;
        let p = GenParams {
            rate,
            seed,
            groups: (count / 16).max(1),
            prompts_per_group: 16,
            output_tokens: 16,
            ..GenParams::defaults(Generator::SharedPrefix)
        };
        let reqs = generate(Generator::SharedPrefix, &p);
        rt.block_on(kvroute_sim::bench::quiet(&url, Api::Chat, &reqs, secs as f64, "soak"))
            .map_err(|e| e.to_string())
    };
    let warmup = (seconds / 4).clamp(5, 300);
    let (w, _) = phase(warmup, 1)?;
    let rss_after_warmup_kib = rss_kib(envoy.pid());
    let every = Duration::from_secs((seconds / 30).max(1));
    let done = std::sync::atomic::AtomicBool::new(false);
    let (run, samples) = std::thread::scope(|scope| {
        let sampler = scope.spawn(|| {
            let mut samples = Vec::new();
            let mut at = 0;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                std::thread::sleep(every);
                at += every.as_secs();
                samples.push((at, rss_kib(envoy.pid()), envoy.stat("wasmcustom.kvroute.index_entries")));
            }
            samples
        });
        let run = phase(seconds, 2);
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        (run, sampler.join().unwrap_or_default())
    });
    let (run, _) = run?;
    std::thread::sleep(Duration::from_millis(500)); // a worker tick publishes the gauges
    Ok(SoakReport {
        seconds,
        requests: run.requests + w.requests,
        completed: run.completed + w.completed,
        failed: run.failed + w.failed,
        prefix_hit_rate: run.prefix_hit_rate,
        rss_after_warmup_kib,
        rss_end_kib: rss_kib(envoy.pid()),
        index_entries: envoy.stat("wasmcustom.kvroute.index_entries"),
        inflight_at_end: envoy.stat("wasmcustom.kvroute.inflight_requests"),
        samples,
    })
}
