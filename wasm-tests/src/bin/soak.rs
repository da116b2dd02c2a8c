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
    println!("{r:#?}");
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
