//! What every measurement shares: the chat bodies it sends, the fast fake servers and the bench
//! Envoy in front of them, and readers of Envoy's CPU time and resident memory from `/proc`
//! (the benchmark reports what kvroute costs Envoy, so it reads Envoy's own figures from the
//! kernel rather than inferring them from the client's side).

use std::time::Duration;

use kvroute_wasm_tests::envoy::Envoy;
use kvroute_wasm_tests::fake_vllm::{FakeVllm, Load, MODEL};

pub fn body(bytes: usize, n: usize) -> String {
    let head = format!(r#"{{"model":"{MODEL}","max_tokens":8,"messages":[{{"role":"user","content":""#);
    let tail = format!(r#" request {n}"}}]}}"#);
    let fill = bytes.saturating_sub(head.len() + tail.len());
    format!("{head}{}{tail}", "a".repeat(fill))
}

pub fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1e6
}

pub fn fleet(n: usize) -> Result<Vec<FakeVllm>, String> {
    (0..n)
        .map(|_| FakeVllm::start(Load::idle()).map_err(|e| e.to_string()))
        .collect()
}

/// Four fast test servers behind `envoy/bench-overhead.yaml` (kvroute, no filter and the
/// empty filter on three listeners), after a few scrapes reached the workers. The servers
/// stop when the returned handles drop.
pub fn bench_envoy() -> Result<(Vec<FakeVllm>, Envoy), String> {
    let servers = fleet(4)?;
    let ports: Vec<u16> = servers.iter().map(|s| s.port).collect();
    let envoy = Envoy::start("bench-overhead.yaml", &ports, |t| t)?;
    std::thread::sleep(Duration::from_millis(600));
    Ok((servers, envoy))
}

/// CPU seconds (user + system) in a `/proc/.../stat` file: a process's (all threads) or,
/// under `task/<tid>/`, one thread's.
fn cpu_s(stat_path: &str) -> Option<f64> {
    let stat = std::fs::read_to_string(stat_path).ok()?;
    let after = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0) // USER_HZ is 100 on Linux
}

pub fn process_cpu_s(pid: u32) -> Option<f64> {
    cpu_s(&format!("/proc/{pid}/stat"))
}

pub fn thread_cpu_s(pid: u32, tid: u32) -> Option<f64> {
    cpu_s(&format!("/proc/{pid}/task/{tid}/stat"))
}

/// Envoy's resident memory as `/proc` reports it (e.g. "123456 kB").
pub fn rss(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .map(|l| l.trim_start_matches("VmRSS:").trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}
