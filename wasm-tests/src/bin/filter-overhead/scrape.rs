//! `scrape [interval_ms]`: what kvroute's polling costs with no traffic. Envoy with kvroute
//! polling 4, 64 and 256 simulated vLLM servers (`kvroute-sim serve`), the pool learned from
//! Envoy's `/clusters` and as a static list: CPU of Envoy's main thread (where the singleton
//! service polls and scrapes) and of the whole process over 20 s. Polling runs whether or not
//! requests arrive, so an idle gateway pays it too.

use std::time::Duration;

use kvroute_wasm_tests::envoy::{repo_root, Envoy};

use crate::common::{process_cpu_s, thread_cpu_s};

/// Envoy (the shipped config, its pool cluster listing `ports`) with kvroute's pool
/// learned from Envoy (`discovered`) or written as the static `endpoints` list, no
/// traffic: CPU of Envoy's main thread (where the singleton service polls and scrapes)
/// and of the whole process over `seconds`, as fractions of one core.
fn poller_cpu(ports: &[u16], discovered: bool, interval_ms: u64, seconds: u64) -> Result<(f64, f64), String> {
    let text = std::fs::read_to_string(repo_root().join("envoy/envoy.yaml")).map_err(|e| e.to_string())?;
    let text = text.replace(
        "\"interval_ms\": 200, \"timeout_ms\": 150",
        &format!("\"interval_ms\": {interval_ms}, \"timeout_ms\": 150"),
    );
    let text = if discovered {
        text
    } else {
        let list: Vec<String> = ports.iter().map(|p| format!("\"127.0.0.1:{p}\"")).collect();
        text.replace(
            "\"cluster_shape\": \"override_host\",",
            &format!(
                "\"endpoints\": [{}], \"cluster_shape\": \"override_host\",",
                list.join(", ")
            ),
        )
    };
    let lb: String = ports
        .iter()
        .map(|p| format!("              - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {p} }} }} }}\n"))
        .collect();
    let start = text
        .find("              - endpoint:")
        .ok_or("no lb_endpoints in envoy.yaml")?;
    let end = text
        .find("port_value: 8004 } } }")
        .ok_or("no lb_endpoints in envoy.yaml")?
        + "port_value: 8004 } } }\n".len();
    let text = format!("{}{}{}", &text[..start], lb, &text[end.min(text.len())..]);
    let envoy = Envoy::start_text(text, &[], |t| t)?;
    std::thread::sleep(Duration::from_secs(3));
    let healthy = envoy.stat("wasmcustom.kvroute.scrape.healthy_endpoints");
    if healthy as usize != ports.len() {
        return Err(format!("{healthy} of {} servers healthy in kvroute", ports.len()));
    }
    let pid = envoy.pid();
    let main_before = thread_cpu_s(pid, pid).ok_or("cannot read Envoy's main thread CPU")?;
    let all_before = process_cpu_s(pid).ok_or("cannot read Envoy's CPU")?;
    std::thread::sleep(Duration::from_secs(seconds));
    let main_after = thread_cpu_s(pid, pid).ok_or("cannot read Envoy's main thread CPU")?;
    let all_after = process_cpu_s(pid).ok_or("cannot read Envoy's CPU")?;
    let per = |a: f64, b: f64| (a - b) / seconds as f64;
    Ok((per(main_after, main_before), per(all_after, all_before)))
}

/// The polling cost at the default intervals (discovery and scrapes every 200 ms,
/// `/v1/models` every 10 s) against simulated vLLM 0.33 servers (`kvroute-sim serve`,
/// whose `/metrics` body is vLLM's full one, about 39 KB), with the pool learned from
/// Envoy and with a static list.
pub fn scrape_cost(interval_ms: u64) -> Result<(), String> {
    let seconds = 20;
    let sim = repo_root().join("target/release/kvroute-sim");
    if !sim.exists() {
        return Err("no target/release/kvroute-sim: run `cargo build --release -p kvroute-sim`".into());
    }
    println!("scrapes every {interval_ms} ms\n");
    println!("| servers | pool | Envoy main-thread CPU | whole Envoy CPU |");
    println!("|---|---|---|---|");
    for n in [4usize, 64, 256] {
        let base = 31_001u16;
        let mut fleet = std::process::Command::new(&sim)
            .args(["serve", "--servers", &n.to_string(), "--base-port", &base.to_string()])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", sim.display()))?;
        let ports: Vec<u16> = (0..n as u16).map(|i| base + i).collect();
        std::thread::sleep(Duration::from_secs(2));
        for discovered in [false, true] {
            let pool = if discovered {
                "learned from Envoy"
            } else {
                "static `endpoints`"
            };
            let result = poller_cpu(&ports, discovered, interval_ms, seconds);
            match result {
                Ok((main, all)) => {
                    println!(
                        "| {n} | {pool} | {:.1}% of one core | {:.1}% |",
                        main * 100.0,
                        all * 100.0
                    )
                }
                Err(e) => println!("| {n} | {pool} | failed: {e} | |"),
            }
        }
        let _ = fleet.kill();
        let _ = fleet.wait();
    }
    Ok(())
}
