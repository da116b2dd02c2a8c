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
//! Usage (from the repository root, after `make build-wasm setup-envoy`):
//!   cargo run --release -p kvroute-wasm-tests --bin filter-overhead -- [all|latency [N]|wrk|scrape [interval_ms]]

#![allow(clippy::disallowed_methods)] // a wall-time benchmark driver reads the clock

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
        "latency" => native::latency(args.get(1).and_then(|a| a.parse().ok()).unwrap_or(2000)),
        "wrk" => native::wrk_sweep(),
        "scrape" => native::scrape_cost(args.get(1).and_then(|a| a.parse().ok()).unwrap_or(200)),
        "presence" => native::presence(),
        "hostile" => native::hostile(),
        "sharing" => native::sharing(),
        "replicas" => native::replicas_cost(args.get(1).and_then(|a| a.parse().ok()).unwrap_or(3)),
        "sharing-timed" => native::sharing_timed(
            args.get(1).and_then(|a| a.parse().ok()).unwrap_or(3),
            args.get(2).map(String::as_str) != Some("every-decision"),
        ),
        "capture" => native::capture(args.get(1).and_then(|a| a.parse().ok()).unwrap_or(3)),
        "capture-pair" => native::capture_pair(args.get(1).and_then(|a| a.parse().ok()).unwrap_or(10)),
        "all" => native::latency(2000)
            .and_then(|_| native::wrk_sweep())
            .and_then(|_| native::presence())
            .and_then(|_| native::hostile())
            .and_then(|_| native::sharing())
            .and_then(|_| native::sharing_timed(3, true))
            .and_then(|_| native::replicas_cost(3))
            .and_then(|_| native::capture(3))
            .and_then(|_| native::capture_pair(10))
            .and_then(|_| native::scrape_cost(200)),
        other => Err(format!(
            "unknown measurement {other:?}: all | latency [N] | wrk | scrape | presence | hostile | sharing | sharing-timed [N [every-decision]] | replicas [N] | capture [N] | capture-pair [N]"
        )),
    }
}

#[cfg(not(target_arch = "wasm32"))]
mod native {
    use std::process::Command;
    use std::time::{Duration, Instant};

    use kvroute_wasm_tests::envoy::{repo_root, Envoy};
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

    /// What most measurements start from: four idle fake servers, their ports, a scratch
    /// directory named after the measurement, and a wrk script POSTing 1 KiB bodies there.
    fn one_kib_bench(name: &str) -> Result<(Vec<FakeVllm>, Vec<u16>, std::path::PathBuf, String), String> {
        let servers = fleet(4)?;
        let ports: Vec<u16> = servers.iter().map(|s| s.port).collect();
        let dir = std::env::temp_dir().join(format!("kvroute-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let script = post_script(&dir, 1024)?;
        Ok((servers, ports, dir, script))
    }

    fn fleet(n: usize) -> Result<Vec<FakeVllm>, String> {
        (0..n)
            .map(|_| FakeVllm::start(Load::idle()).map_err(|e| e.to_string()))
            .collect()
    }

    /// Four fast test servers behind `envoy/bench-overhead.yaml` (kvroute, no filter and the
    /// empty filter on three listeners), after a few scrapes reached the workers. The servers
    /// stop when the returned handles drop.
    fn bench_envoy() -> Result<(Vec<FakeVllm>, Envoy), String> {
        let servers = fleet(4)?;
        let ports: Vec<u16> = servers.iter().map(|s| s.port).collect();
        let envoy = Envoy::start("bench-overhead.yaml", &ports, |t| t)?;
        std::thread::sleep(Duration::from_millis(600));
        Ok((servers, envoy))
    }

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
        let routed =
            envoy.stat("wasmcustom.kvroute.decision.cold") + envoy.stat("wasmcustom.kvroute.decision.prefix_hit");
        println!("\nkvroute routed {routed} requests (decision.cold + decision.prefix_hit).\n");
        Ok(())
    }

    struct WrkResult {
        rps: f64,
        p50_us: f64,
        p99_us: f64,
        /// Envoy's CPU time (all threads, user + system) per request served in the run.
        envoy_cpu_us: f64,
        errors: bool,
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

    fn process_cpu_s(pid: u32) -> Option<f64> {
        cpu_s(&format!("/proc/{pid}/stat"))
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

    fn wrk_path(
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
    fn post_script(dir: &std::path::Path, size: usize) -> Result<String, String> {
        let script = dir.join(format!("post-{size}.lua"));
        let b = body(size, 0).replace('\\', "\\\\").replace('"', "\\\"");
        std::fs::write(
            &script,
            format!(
                "wrk.method = \"POST\"\nwrk.headers[\"content-type\"] = \"application/json\"\nwrk.body = \"{b}\"\n"
            ),
        )
        .map_err(|e| e.to_string())?;
        Ok(script.to_string_lossy().to_string())
    }

    /// wrk on each listener in the order A B C C B A (linear drift hits every side alike);
    /// each side's figures are the mean of its two runs.
    fn wrk_abccba(
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
        let routed =
            envoy.stat("wasmcustom.kvroute.decision.cold") + envoy.stat("wasmcustom.kvroute.decision.prefix_hit");
        println!(
            "\nEnvoy (--concurrency 2) resident memory after the sweep: {rss}; kvroute routed {routed} requests.\n"
        );
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }

    /// Hostile request bodies just under `max_body_bytes` (4 MiB): (name, path, body).
    fn hostile_bodies() -> Vec<(&'static str, &'static str, Vec<u8>)> {
        const CAP: usize = (4 << 20) - 256;
        let chat = "/v1/chat/completions";
        let one = r#"{"role":"user","content":"hi"},"#;
        let many = format!(
            r#"{{"model":"{MODEL}","messages":[{}{{"role":"user","content":"end"}}]}}"#,
            one.repeat(CAP / one.len() - 2)
        );
        let escapes = format!(
            r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"{}"}}]}}"#,
            "\\u00e9".repeat(CAP / 6 - 20)
        );
        let plain = format!(
            r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"{}"}}]}}"#,
            "lorem ipsum ".repeat(CAP / 12 - 10)
        );
        let ids = format!(r#"{{"model":"{MODEL}","prompt":[{}1]}}"#, "1,".repeat(CAP / 2 - 20));
        let nested = format!(
            r#"{{"model":"{MODEL}","tools":{}{},"messages":[{{"role":"user","content":"x"}}]}}"#,
            "[".repeat(CAP / 2 - 100),
            "]".repeat(CAP / 2 - 100)
        );
        let duplicates = format!(
            r#"{{"model":"{MODEL}",{}"messages":[{{"role":"user","content":"x"}}]}}"#,
            r#""model":"m","#.repeat(CAP / 12 - 10)
        );
        let mut invalid_utf8 = plain.clone().into_bytes();
        for i in (100..invalid_utf8.len() - 100).step_by(4096) {
            invalid_utf8[i] = 0xff;
        }
        vec![
            (
                "4 MiB of plain text (hashing capped at max_blocks)",
                chat,
                plain.into_bytes(),
            ),
            ("130k tiny messages (stopped at 4096)", chat, many.into_bytes()),
            ("700k \\u escapes", chat, escapes.into_bytes()),
            ("2M token ids (completions)", "/v1/completions", ids.into_bytes()),
            ("2M-deep nesting in tools", chat, nested.into_bytes()),
            ("350k duplicate keys", chat, duplicates.into_bytes()),
            ("invalid UTF-8 every 4 KiB", chat, invalid_utf8),
        ]
    }

    pub fn hostile() -> Result<(), String> {
        let (_servers, envoy) = bench_envoy()?;
        println!("| body (just under 4 MiB) | bytes | median without | median with kvroute | added median | worst added | status |");
        println!("|---|---|---|---|---|---|---|");
        for (name, path, body) in hostile_bodies() {
            let mut clients = [KeepAlive::connect(envoy.port2)?, KeepAlive::connect(envoy.port)?];
            let mut times: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
            let mut statuses = std::collections::BTreeSet::new();
            for n in 0..12 {
                for (client, t) in clients.iter_mut().zip(times.iter_mut()) {
                    let start = Instant::now();
                    let status = client.post(path, &body)?;
                    let took = start.elapsed().as_secs_f64() * 1e3;
                    statuses.insert(status);
                    if n >= 2 {
                        t.push(took); // 2 warm-up requests
                    }
                }
            }
            // Each kvroute request against the no-filter request sent just before it.
            let worst_added = times[1]
                .iter()
                .zip(times[0].iter())
                .map(|(w, o)| w - o)
                .fold(f64::MIN, f64::max);
            for t in &mut times {
                t.sort_by(f64::total_cmp);
            }
            let med = |t: &[f64]| t[t.len() / 2];
            println!(
                "| {name} | {} | {:.1} ms | {:.1} ms | {:+.1} ms | {:+.1} ms | {:?} |",
                body.len(),
                med(&times[0]),
                med(&times[1]),
                med(&times[1]) - med(&times[0]),
                worst_added,
                statuses
            );
        }
        println!(
            "\nEnvoy alive: {}; wasm VM reloads: {}; kvroute skipped as malformed: {}.\n",
            envoy.stat("server.live") == 1,
            envoy.stat("wasm.kvroute.vm_reload"),
            envoy.stat("wasmcustom.kvroute.skipped.malformed")
        );
        Ok(())
    }

    /// Envoy's resident memory as `/proc` reports it (e.g. "123456 kB").
    fn rss(pid: u32) -> String {
        std::fs::read_to_string(format!("/proc/{pid}/status"))
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("VmRSS:"))
                    .map(|l| l.trim_start_matches("VmRSS:").trim().to_string())
            })
            .unwrap_or_else(|| "unknown".into())
    }

    /// How kvroute's workers share: at each decision and on the tick (the default), on the
    /// tick only, or not at all.
    #[derive(Clone, Copy, PartialEq)]
    enum Sharing {
        OnRequest,
        TickOnly,
        Off,
    }

    /// The bench Envoy with `workers` workers sharing as `sharing` says.
    fn sharing_envoy(ports: &[u16], workers: u32, sharing: Sharing) -> Result<Envoy, String> {
        let edit = move |t: String| {
            let share = match sharing {
                Sharing::OnRequest => "",
                Sharing::TickOnly => " \"share\": {\"on_request\": false},",
                Sharing::Off => " \"share\": {\"workers\": false},",
            };
            t.replace("\"policy\": \"cost\",", &format!("\"policy\": \"cost\",{share}"))
        };
        let envoy = Envoy::start_workers("bench-overhead.yaml", ports, workers, edit)?;
        std::thread::sleep(Duration::from_millis(600));
        Ok(envoy)
    }

    /// `sharing`: what one view per process costs. Envoy CPU per request on the kvroute
    /// listener (1 KiB, 8 connections, wrk 4 s, each variant twice in the order
    /// on-request / tick-only / off / off / tick-only / on-request, a fresh Envoy each run),
    /// at 2 and 8 workers; then at 32 workers, Envoy's resident memory after traffic and its
    /// CPU while idle, sharing and not.
    pub fn sharing() -> Result<(), String> {
        let (_servers, ports, dir, script) = one_kib_bench("sharing")?;
        println!("| workers | Envoy CPU/req: sharing, defaults (`on_request`, hits on the tick) | tick only | not sharing | added (defaults) | added (tick only) | req/s defaults / tick only / not sharing |");
        println!("|---|---|---|---|---|---|---|");
        let order = [Sharing::OnRequest, Sharing::TickOnly, Sharing::Off];
        for workers in [2u32, 8] {
            let mut runs: [Vec<WrkResult>; 3] = [Vec::new(), Vec::new(), Vec::new()];
            for i in [0usize, 1, 2, 2, 1, 0] {
                let envoy = sharing_envoy(&ports, workers, order[i])?;
                runs[i].push(wrk_path(&envoy, envoy.port, "/v1/chat/completions", &script, 8, 4)?);
            }
            let mean = |r: &[WrkResult], f: fn(&WrkResult) -> f64| r.iter().map(f).sum::<f64>() / r.len() as f64;
            let cpu = [0, 1, 2].map(|i| mean(&runs[i], |r| r.envoy_cpu_us));
            let rps = [0, 1, 2].map(|i| mean(&runs[i], |r| r.rps));
            println!(
                "| {workers} | {:.1} µs | {:.1} µs | {:.1} µs | {:+.1} µs | {:+.1} µs | {:.0} / {:.0} / {:.0} |",
                cpu[0],
                cpu[1],
                cpu[2],
                cpu[0] - cpu[2],
                cpu[1] - cpu[2],
                rps[0],
                rps[1],
                rps[2]
            );
        }
        println!("\n| 32 workers | RSS after 8 s of wrk (8 connections, 1 KiB) | Envoy CPU while idle (10 s) | peer events applied |");
        println!("|---|---|---|---|");
        for sharing in [Sharing::OnRequest, Sharing::Off] {
            let envoy = sharing_envoy(&ports, 32, sharing)?;
            wrk_path(&envoy, envoy.port, "/v1/chat/completions", &script, 8, 8)?;
            std::thread::sleep(Duration::from_secs(1));
            let before = process_cpu_s(envoy.pid()).unwrap_or(0.0);
            std::thread::sleep(Duration::from_secs(10));
            let idle = process_cpu_s(envoy.pid()).unwrap_or(0.0) - before;
            println!(
                "| {} | {} | {:.1}% of a core | {} |",
                if sharing == Sharing::Off {
                    "not sharing"
                } else {
                    "sharing"
                },
                rss(envoy.pid()),
                idle * 10.0,
                envoy.stat("wasmcustom.kvroute.mesh.events_applied")
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }

    /// `sharing-timed`: the worker mesh's own work, timed inside the VMs by the host clock
    /// (the `self-timing` build: `mesh.ns_*` counters, summed over every worker), per request
    /// routed: applying peers' events before scoring, publishing the placement after, and the
    /// tick's exchange. Host calls are inside the spans; each span also holds two clock reads.
    /// wrk 1 KiB, 8 connections, 4 s after 2 s of warm-up, `rounds` fresh Envoys per worker
    /// count; `every-decision` sets `share.hits_on_tick` off. The Envoy-wide differential
    /// (`sharing`) moves by ±20 µs a request between
    /// Envoys on a shared VM; this does not.
    pub fn sharing_timed(rounds: usize, hits_on_tick: bool) -> Result<(), String> {
        if !repo_root().join("dist/kvroute-self-timing.wasm").exists() {
            return Err("no dist/kvroute-self-timing.wasm: run `make build-wasm-self-timing`".into());
        }
        let (_servers, ports, dir, script) = one_kib_bench("sharing-timed")?;
        let parts = ["before_route", "after_route", "tick", "apply"];
        println!("| workers | before scoring | after routing | tick | sharing in all, per request | of which applying peers' events | req/s | events applied per request |");
        println!("|---|---|---|---|---|---|---|---|");
        for workers in [2u32, 8] {
            let mut per_req: Vec<[f64; 5]> = Vec::new();
            let (mut rps, mut applied) = (Vec::new(), Vec::new());
            for _ in 0..rounds.max(1) {
                let edit = |t: String| {
                    let t = t.replace("dist/kvroute.wasm", "dist/kvroute-self-timing.wasm");
                    if hits_on_tick {
                        t
                    } else {
                        t.replace(
                            "\"policy\": \"cost\",",
                            "\"policy\": \"cost\", \"share\": {\"hits_on_tick\": false},",
                        )
                    }
                };
                let envoy = Envoy::start_workers("bench-overhead.yaml", &ports, workers, edit)?;
                std::thread::sleep(Duration::from_millis(600));
                wrk_path(&envoy, envoy.port, "/v1/chat/completions", &script, 8, 2)?;
                let read = |envoy: &Envoy| {
                    let ns = parts.map(|p| envoy.stat(&format!("wasmcustom.kvroute.mesh.ns_{p}")) as f64);
                    let routed = ["prefix_hit", "cold"]
                        .map(|d| envoy.stat(&format!("wasmcustom.kvroute.decision.{d}")))
                        .iter()
                        .sum::<u64>() as f64;
                    (ns, routed, envoy.stat("wasmcustom.kvroute.mesh.events_applied") as f64)
                };
                let (ns0, routed0, applied0) = read(&envoy);
                let run = wrk_path(&envoy, envoy.port, "/v1/chat/completions", &script, 8, 4)?;
                let (ns1, routed1, applied1) = read(&envoy);
                let n = (routed1 - routed0).max(1.0);
                let us = [0, 1, 2, 3].map(|i| (ns1[i] - ns0[i]) / n / 1000.0);
                per_req.push([us[0], us[1], us[2], us[0] + us[1] + us[2], us[3]]);
                rps.push(run.rps);
                applied.push((applied1 - applied0) / n);
            }
            let median = |mut v: Vec<f64>| {
                v.sort_by(f64::total_cmp);
                v[v.len() / 2]
            };
            let col = |i: usize| median(per_req.iter().map(|r| r[i]).collect());
            let totals: Vec<f64> = per_req.iter().map(|r| r[3]).collect();
            let (lo, hi) = totals
                .iter()
                .fold((f64::MAX, f64::MIN), |(a, b), t| (a.min(*t), b.max(*t)));
            println!(
                "| {workers} | {:.2} µs | {:.2} µs | {:.2} µs | {:.2} µs [{lo:.2}–{hi:.2}] | {:.2} µs | {:.0} | {:.2} |",
                col(0),
                col(1),
                col(2),
                col(3),
                col(4),
                median(rps),
                median(applied)
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }

    /// `replicas`: what exchanging with gateway replicas costs the sender and the receiver.
    /// One Envoy listed as its own only replica (`share.replicas.peers` = its kvroute
    /// listener): every batch it forwards goes out through the replicas' cluster and comes
    /// back to its own filter, which answers it — one peer's send and receive in one process
    /// (its own batches are recognised and dropped, so nothing is applied twice). Envoy CPU
    /// per request on the kvroute listener, wrk 1 KiB, 8 connections, 2 workers, 4 s after 2 s
    /// of warm-up, a fresh Envoy per run, `rounds` × (off, every 5 ms, at once, at once,
    /// every 5 ms, off); batches POSTed a second.
    pub fn replicas_cost(rounds: usize) -> Result<(), String> {
        let (_servers, ports, dir, script) = one_kib_bench("replicas-cost")?;
        let fragment = std::fs::read_to_string(repo_root().join("envoy/fragments/replicas-cluster.yaml"))
            .map_err(|e| e.to_string())?;
        let mut runs: [Vec<WrkResult>; 3] = [Vec::new(), Vec::new(), Vec::new()];
        let mut batches: [Vec<f64>; 3] = [Vec::new(), Vec::new(), Vec::new()];
        for side in [0usize, 1, 2, 2, 1, 0].repeat(rounds.max(1)) {
            let listen = kvroute_wasm_tests::envoy::free_port();
            let cluster: String = fragment
                .lines()
                .filter(|l| !l.starts_with('#') && !l.contains("port_value: 10200"))
                .collect::<Vec<_>>()
                .join("\n")
                .replace("port_value: 10100", &format!("port_value: {listen}"));
            let edit = move |t: String| {
                if side == 0 {
                    return t;
                }
                let share = format!(
                    r#""policy": "cost", "share": {{"replicas": {{"peers": ["127.0.0.1:{listen}"], "secret": "bench-replicas-secret-0123", "at_once": {}}}}},"#,
                    side == 2
                );
                t.replacen("\"policy\": \"cost\",", &share, 1).replacen(
                    "  clusters:\n",
                    &format!("  clusters:\n{cluster}\n"),
                    1,
                )
            };
            let envoy = Envoy::start_listening("bench-overhead.yaml", &ports, 2, Some(listen), edit)?;
            std::thread::sleep(Duration::from_millis(600));
            wrk_path(&envoy, envoy.port, "/v1/chat/completions", &script, 8, 2)?;
            let sent0 = envoy.stat("wasmcustom.kvroute.replicas.batches_sent");
            runs[side].push(wrk_path(&envoy, envoy.port, "/v1/chat/completions", &script, 8, 4)?);
            batches[side].push(
                envoy
                    .stat("wasmcustom.kvroute.replicas.batches_sent")
                    .saturating_sub(sent0) as f64
                    / 4.0,
            );
        }
        let sorted = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v
        };
        let mid = |v: &[f64]| v[v.len() / 2];
        let cpu = [0, 1, 2].map(|i| sorted(runs[i].iter().map(|r| r.envoy_cpu_us).collect()));
        println!("{} runs per side; medians [min–max]\n", cpu[0].len());
        println!("| 1 KiB, 8 connections, 2 workers | Envoy CPU/req | added | batches a second | req/s |");
        println!("|---|---|---|---|---|");
        for (i, label) in [
            "no replicas",
            "one replica (itself), every 5 ms",
            "one replica (itself), at once",
        ]
        .iter()
        .enumerate()
        {
            let c = &cpu[i];
            println!(
                "| {label} | {:.1} µs [{:.1}–{:.1}] | {:+.1} µs | {:.0} | {:.0} |",
                mid(c),
                c[0],
                c[c.len() - 1],
                mid(c) - mid(&cpu[0]),
                mid(&sorted(batches[i].clone())),
                mid(&sorted(runs[i].iter().map(|r| r.rps).collect()))
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }

    /// `capture`: what traffic capture costs. Envoy CPU per request on the kvroute listener
    /// (1 KiB, 8 connections, wrk 4 s after 2 s of warm-up, a fresh Envoy each run, `rounds` times in the order
    /// off / filter only / with the access log, then back), capture sampling every request:
    /// the filter's part (ids, the line, one host call) alone, then with the shipped access
    /// log writing it. Medians and ranges: one run moves by more than the effect.
    pub fn capture(rounds: usize) -> Result<(), String> {
        let (_servers, ports, dir, script) = one_kib_bench("capture")?;
        let log = dir.join("capture.jsonl");
        let after = "\"policy\": \"cost\"";
        let on = "\"sample\": 1.0, \"salt\": \"bench-capture-salt-0123\"";
        let mut runs: [Vec<WrkResult>; 3] = [Vec::new(), Vec::new(), Vec::new()];
        let mut lines = 0;
        for side in [0usize, 1, 2, 2, 1, 0].repeat(rounds.max(1)) {
            let _ = std::fs::remove_file(&log);
            let edit = |t: String| match side {
                0 => t,
                // The filter writes the line; no access log reads it.
                1 => t.replacen(after, &format!("{after}, \"capture\": {{{on}}}"), 1),
                _ => kvroute_wasm_tests::envoy::with_capture(&t, &log, after, on),
            };
            let envoy = Envoy::start("bench-overhead.yaml", &ports, edit)?;
            std::thread::sleep(Duration::from_millis(600));
            // A fresh V8 first runs the module's baseline code and compiles the optimised
            // tier in the background, on Envoy's CPU time: warm it before measuring.
            wrk_path(&envoy, envoy.port, "/v1/chat/completions", &script, 8, 2)?;
            runs[side].push(wrk_path(&envoy, envoy.port, "/v1/chat/completions", &script, 8, 4)?);
            if side == 2 {
                drop(envoy);
                lines += std::fs::read_to_string(&log).map(|t| t.lines().count()).unwrap_or(0);
            }
        }
        let stats = |side: usize, f: fn(&WrkResult) -> f64| {
            let mut v: Vec<f64> = runs[side].iter().map(f).collect();
            v.sort_by(f64::total_cmp);
            (v[v.len() / 2], v[0], v[v.len() - 1])
        };
        // Added CPU: each run against the capture-off run of the same round and half.
        let added = |side: usize| {
            let mut v: Vec<f64> = runs[side]
                .iter()
                .zip(&runs[0])
                .map(|(with, off)| with.envoy_cpu_us - off.envoy_cpu_us)
                .collect();
            v.sort_by(f64::total_cmp);
            format!("{:+.1} µs [{:+.1} to {:+.1}]", v[v.len() / 2], v[0], v[v.len() - 1])
        };
        println!("{} runs per side; medians [min–max]\n", runs[0].len());
        println!("| 1 KiB, 8 connections, sampling 100% | Envoy CPU/req | added (paired with capture off) | req/s |");
        println!("|---|---|---|---|");
        let labels = [
            "capture off",
            "filter writes the line (no access log)",
            "filter + the shipped access log",
        ];
        for (side, label) in labels.iter().enumerate() {
            let (cpu, lo, hi) = stats(side, |r| r.envoy_cpu_us);
            let (rps, _, _) = stats(side, |r| r.rps);
            let add = if side == 0 { String::new() } else { added(side) };
            println!("| {label} | {cpu:.1} µs [{lo:.1}–{hi:.1}] | {add} | {rps:.0} |");
        }
        println!("\nlines written by the access log over its two runs: {lines}");
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }

    /// The bench config with its empty-filter listener replaced by a second kvroute listener
    /// (its own VM, `vm_id: kvroute_capture`) that captures every request and writes the
    /// shipped access log to `log`.
    fn capture_listener(text: String, log: &std::path::Path) -> String {
        let cut = |from: &str, to: &str| -> Option<(usize, usize)> {
            let a = text.find(from)?;
            Some((a, a + text[a..].find(to)?))
        };
        let (Some((k0, k1)), Some((e0, e1)), Some((j0, j1))) = (
            cut("    - name: inference\n", "    - name: inference_no_filter\n"),
            cut("    - name: inference_empty_filter\n", "  clusters:"),
            cut("value: &kvroute_config |\n", "\nstatic_resources"),
        ) else {
            return text;
        };
        let json: String = text[j0..j1]
            .lines()
            .skip(1)
            .map(str::trim)
            .collect::<Vec<_>>()
            .join(" ")
            .replacen(
                "\"policy\": \"cost\",",
                "\"policy\": \"cost\", \"capture\": {\"sample\": 1.0, \"salt\": \"bench-capture-salt-0123\"},",
                1,
            );
        let port_line = text[e0..e1]
            .lines()
            .find(|l| l.contains("port_value"))
            .unwrap_or_default();
        let kvroute = &text[k0..k1];
        let own_port = kvroute.lines().find(|l| l.contains("port_value")).unwrap_or_default();
        let capture = kvroute
            .replacen("    - name: inference\n", "    - name: inference_capture\n", 1)
            .replacen(own_port, port_line, 1)
            .replacen(
                "                stat_prefix: inference\n",
                &format!(
                    "                stat_prefix: inference_capture\n{}",
                    kvroute_wasm_tests::envoy::capture_log(log)
                ),
                1,
            )
            .replacen("name: kvroute\n", "name: kvroute_capture\n", 1)
            .replacen("vm_id: kvroute\n", "vm_id: kvroute_capture\n", 1)
            .replacen("dist/kvroute.wasm", "dist/kvroute-self-timing.wasm", 1)
            .replacen("value: *kvroute_config", &format!("value: '{json}'"), 1);
        format!("{}{}{}", &text[..e0], capture, &text[e1..])
    }

    /// `capture-pair`: capture's cost in one Envoy, one VM per side: the kvroute listener
    /// without capture and a second kvroute listener (its own VM, the `self-timing` build,
    /// which also reports the time its capture code takes) capturing every request through
    /// the shipped access log, wrk 4 s on each in turn (A B B A, `rounds` times,
    /// after 4 s of warm-up on each), 1 KiB, 8 connections. No fresh process per run: the
    /// fresh-Envoy runs of `capture` move by ±20 µs a request from one Envoy to the next.
    pub fn capture_pair(rounds: usize) -> Result<(), String> {
        if !repo_root().join("dist/kvroute-self-timing.wasm").exists() {
            return Err("no dist/kvroute-self-timing.wasm: run `make build-wasm-self-timing`".into());
        }
        let (_servers, ports, dir, script) = one_kib_bench("capture-pair")?;
        let log = dir.join("capture.jsonl");
        let envoy = Envoy::start("bench-overhead.yaml", &ports, |t| capture_listener(t, &log))?;
        std::thread::sleep(Duration::from_millis(1500));
        let sides = [envoy.port, envoy.port3];
        for port in sides {
            wrk_path(&envoy, port, "/v1/chat/completions", &script, 8, 4)?;
        }
        let mut runs: [Vec<WrkResult>; 2] = [Vec::new(), Vec::new()];
        for side in [0usize, 1, 1, 0].repeat(rounds.max(1)) {
            runs[side].push(wrk_path(&envoy, sides[side], "/v1/chat/completions", &script, 8, 4)?);
        }
        let sorted = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v
        };
        let cpu = |side: usize| sorted(runs[side].iter().map(|r| r.envoy_cpu_us).collect());
        let added = sorted(
            runs[1]
                .iter()
                .zip(&runs[0])
                .map(|(on, off)| on.envoy_cpu_us - off.envoy_cpu_us)
                .collect(),
        );
        let mid = |v: &[f64]| v[v.len() / 2];
        println!("{} runs per side in one Envoy; medians [min–max]\n", runs[0].len());
        println!("| 1 KiB, 8 connections | Envoy CPU/req, capture off | capture 100% + access log | added (paired) | errors |");
        println!("|---|---|---|---|---|");
        let (off, on) = (cpu(0), cpu(1));
        println!(
            "| same process | {:.1} µs [{:.1}–{:.1}] | {:.1} µs [{:.1}–{:.1}] | {:+.1} µs [{:+.1} to {:+.1}] | {} |",
            mid(&off),
            off[0],
            off[off.len() - 1],
            mid(&on),
            on[0],
            on[on.len() - 1],
            mid(&added),
            added[0],
            added[added.len() - 1],
            runs.iter().flatten().any(|r| r.errors)
        );
        let captured = envoy.stat("wasmcustom.kvroute.capture.lines");
        // Each timed span includes one host clock read (≈ 0.4 µs here).
        for part in ["request", "line", "set_property"] {
            let ns = envoy.stat(&format!("wasmcustom.kvroute.capture.ns_{part}"));
            println!("in the VM, {part}: {:.0} ns a line", ns as f64 / captured.max(1) as f64);
        }
        drop(envoy);
        let lines = std::fs::read_to_string(&log).map(|t| t.lines().count()).unwrap_or(0);
        println!("\ncapture.lines {captured}, lines in the access log file {lines}");
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

    fn thread_cpu_s(pid: u32, tid: u32) -> Option<f64> {
        cpu_s(&format!("/proc/{pid}/task/{tid}/stat"))
    }

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
}
