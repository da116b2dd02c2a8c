//! Load from `wrk` (Debian's HTTP load tool): one run against one listener, read back as
//! requests/s, latency p50/p99 and Envoy's CPU time per request served; the three listeners
//! loaded in the order A B C C B A so linear drift hits every side alike; the POST scripts
//! and the scratch directory most measurements start from.

use std::process::Command;

use kvroute_wasm_tests::envoy::Envoy;
use kvroute_wasm_tests::fake_vllm::FakeVllm;

use crate::common::{body, fleet, process_cpu_s};

/// What most measurements start from: four idle fake servers, their ports, a scratch
/// directory named after the measurement, and a wrk script POSTing 1 KiB bodies there.
pub fn one_kib_bench(name: &str) -> Result<(Vec<FakeVllm>, Vec<u16>, std::path::PathBuf, String), String> {
    let servers = fleet(4)?;
    let ports: Vec<u16> = servers.iter().map(|s| s.port).collect();
    let dir = std::env::temp_dir().join(format!("kvroute-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let script = post_script(&dir, 1024)?;
    Ok((servers, ports, dir, script))
}

pub struct WrkResult {
    pub rps: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    /// Envoy's CPU time (all threads, user + system) per request served in the run.
    pub envoy_cpu_us: f64,
    pub errors: bool,
}

fn micros(v: &str) -> Option<f64> {
    let v = v.trim();
    let (num, unit) = v.split_at(v.find(|c: char| c.is_ascii_alphabetic())?);
    let n: f64 = num.parse().ok()?;
    Some(match unit {
        "us" => n,
        "ms" => n * 1e3,
        "s" => n * 1e6,
        _ => return None,
    })
}

pub fn wrk_path(
    envoy: &Envoy,
    port: u16,
    path: &str,
    script: &str,
    connections: usize,
    seconds: u32,
) -> Result<WrkResult, String> {
    let cpu_before = process_cpu_s(envoy.pid()).ok_or("cannot read Envoy's CPU time")?;
    let out = Command::new("wrk")
        .args([
            "-t",
            "1",
            "-c",
            &connections.to_string(),
            "-d",
            &format!("{seconds}s"),
            "--latency",
            "-s",
            script,
        ])
        .arg(format!("http://127.0.0.1:{port}{path}"))
        .output()
        .map_err(|e| format!("cannot run wrk (apt-get install wrk): {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let find = |prefix: &str| {
        text.lines()
            .find_map(|l| l.trim().strip_prefix(prefix).map(str::to_string))
    };
    let rps = find("Requests/sec:")
        .and_then(|v| v.trim().parse().ok())
        .ok_or(format!("wrk output: {text}"))?;
    let p50 = find("50%")
        .and_then(|v| micros(&v))
        .ok_or(format!("wrk output: {text}"))?;
    let p99 = find("99%")
        .and_then(|v| micros(&v))
        .ok_or(format!("wrk output: {text}"))?;
    let cpu = process_cpu_s(envoy.pid()).ok_or("cannot read Envoy's CPU time")? - cpu_before;
    let requests: f64 = text
        .lines()
        .find_map(|l| {
            l.trim()
                .split_once(" requests in")
                .and_then(|(n, _)| n.trim().parse().ok())
        })
        .ok_or(format!("wrk output: {text}"))?;
    let errors = text.contains("Non-2xx") || text.contains("Socket errors");
    Ok(WrkResult {
        rps,
        p50_us: p50,
        p99_us: p99,
        envoy_cpu_us: cpu * 1e6 / requests.max(1.0),
        errors,
    })
}

/// A wrk script POSTing a fixed chat body of `size` bytes; returns its path.
pub fn post_script(dir: &std::path::Path, size: usize) -> Result<String, String> {
    body_script(dir, &format!("post-{size}"), &body(size, 0))
}

/// A wrk script POSTing `body` (JSON) as `<name>.lua` in `dir`; returns its path.
pub fn body_script(dir: &std::path::Path, name: &str, body: &str) -> Result<String, String> {
    let script = dir.join(format!("{name}.lua"));
    let b = body.replace('\\', "\\\\").replace('"', "\\\"");
    std::fs::write(
        &script,
        format!("wrk.method = \"POST\"\nwrk.headers[\"content-type\"] = \"application/json\"\nwrk.body = \"{b}\"\n"),
    )
    .map_err(|e| e.to_string())?;
    Ok(script.to_string_lossy().to_string())
}

/// A wrk script whose every request starts its prompt with a number no request of any run
/// used (the run's start second, modulo 100,000, × 100,000, counting up; Lua prints 14
/// digits): every prompt is a cold prefix, so every placement is news
/// (`PeerEvent::is_news`). About `size` bytes.
pub fn unique_post_script(dir: &std::path::Path, size: usize) -> Result<String, String> {
    let script = dir.join(format!("post-unique-{size}.lua"));
    let b = body(size.saturating_sub(12), 0);
    let at = b.find(r#""content":""#).ok_or("no content in the body")? + r#""content":""#.len();
    let lua = |t: &str| t.replace('\\', "\\\\").replace('"', "\\\"");
    std::fs::write(
        &script,
        format!(
            "wrk.method = \"POST\"\nwrk.headers[\"content-type\"] = \"application/json\"\nlocal head = \"{}\"\nlocal tail = \"{}\"\nlocal n = (os.time() % 100000) * 100000\nrequest = function()\n  n = n + 1\n  return wrk.format(nil, nil, nil, head .. n .. \" \" .. tail)\nend\n",
            lua(&b[..at]),
            lua(&b[at..])
        ),
    )
    .map_err(|e| e.to_string())?;
    Ok(script.to_string_lossy().to_string())
}

/// wrk on each listener in the order A B C C B A (linear drift hits every side alike);
/// each side's figures are the mean of its two runs.
pub fn wrk_abccba(
    envoy: &Envoy,
    path: &str,
    script: &str,
    connections: usize,
    seconds: u32,
) -> Result<[WrkResult; 3], String> {
    let ports = [envoy.port2, envoy.port3, envoy.port];
    let mut runs: [Vec<WrkResult>; 3] = [Vec::new(), Vec::new(), Vec::new()];
    for side in [0usize, 1, 2, 2, 1, 0] {
        runs[side].push(wrk_path(envoy, ports[side], path, script, connections, seconds)?);
    }
    Ok(runs.map(|r| {
        let n = r.len() as f64;
        WrkResult {
            rps: r.iter().map(|x| x.rps).sum::<f64>() / n,
            p50_us: r.iter().map(|x| x.p50_us).sum::<f64>() / n,
            p99_us: r.iter().map(|x| x.p99_us).sum::<f64>() / n,
            envoy_cpu_us: r.iter().map(|x| x.envoy_cpu_us).sum::<f64>() / n,
            errors: r.iter().any(|x| x.errors),
        }
    }))
}
