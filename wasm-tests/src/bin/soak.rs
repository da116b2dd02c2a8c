//! `soak [SECONDS] [RATE]`: steady traffic through Envoy + kvroute + the simulated fleet
//! (default 1800 s at 40 req/s); prints the figures BENCHMARKS.md records.

#[cfg(target_arch = "wasm32")]
fn main() {}

#[cfg(not(target_arch = "wasm32"))]
fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let seconds = args.first().and_then(|a| a.parse().ok()).unwrap_or(1800);
    let rate = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(40.0);
    let r = kvroute_wasm_tests::soak::soak(seconds, rate)?;
    println!(
        "requests {} completed {} failed {} prefix hit rate {:.3} index entries {} in flight at end {}",
        r.requests, r.completed, r.failed, r.prefix_hit_rate, r.index_entries, r.inflight_at_end
    );
    println!("| s into the run | Envoy RSS (MiB) | index entries |\n|---|---|---|");
    for (at, rss, entries) in &r.samples {
        println!("| {at} | {:.1} | {entries} |", *rss as f64 / 1024.0);
    }
    println!(
        "Envoy RSS after warm-up {:.1} MiB, at the end {:.1} MiB",
        r.rss_after_warmup_kib as f64 / 1024.0,
        r.rss_end_kib as f64 / 1024.0
    );
    println!("Envoy RSS growth after warm-up: {:+.1}%", r.rss_growth() * 100.0);
    if r.failed > 0 || r.rss_growth() > 0.10 {
        return Err(format!(
            "soak failed: {} failed requests, RSS growth {:+.1}%",
            r.failed,
            r.rss_growth() * 100.0
        ));
    }
    Ok(())
}
