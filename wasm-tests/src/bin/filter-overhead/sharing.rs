//! `sharing`, `sharing-timed [N [every-decision]]` and `replicas [N]`: what sharing routing
//! state costs. Inside one Envoy, kvroute's workers share one view (at each decision and on
//! the tick, on the tick only, or not at all); across gateway replicas, they exchange
//! placements over HTTP. Envoy-wide CPU per request (`sharing`, `replicas`) moves by ±20 µs
//! between fresh Envoys, so `sharing-timed` also times the mesh's own work inside the VMs
//! with the `self-timing` build.

use std::time::Duration;

use kvroute_wasm_tests::envoy::{repo_root, Envoy};

use crate::common::{process_cpu_s, rss};
use crate::wrk::{one_kib_bench, wrk_path, WrkResult};

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
/// Two Envoys (A and B), each with the replicas' cluster and `share.replicas.peers` naming
/// both (a replica finds its own address and does not send to it): wrk drives A only, so A pays for
/// sending its placements and B for taking them. Envoy CPU per request of A's traffic, A's
/// and B's, wrk 1 KiB, 8 connections, 2 workers each, 4 s after 2 s of warm-up, fresh Envoys
/// per run, `rounds` × (off, every 5 ms, at once, from the workers, and back); POSTs A
/// sent a second (the service's batches, and the workers' own with `from_workers`).
/// With `unique`, every request's prompt is a prefix no request used before (every
/// placement is news: the most a worker sends itself with `from_workers`).
pub fn replicas_cost(rounds: usize, unique: bool) -> Result<(), String> {
    let (_servers, ports, dir, script) = one_kib_bench("replicas-cost")?;
    let script = if unique {
        crate::wrk::unique_post_script(&dir, 1024)?
    } else {
        script
    };
    let fragment = std::fs::read_to_string(repo_root().join("envoy/fragments/replicas-cluster.yaml"))
        .map_err(|e| e.to_string())?;
    const SECONDS: f64 = 4.0;
    // The workers' POST budget (`share.replicas.from_workers_per_s`) of the fourth side:
    // the filter's default unless FROM_WORKERS_PER_S says otherwise.
    let per_s: u32 = match std::env::var("FROM_WORKERS_PER_S") {
        Ok(v) => v
            .parse()
            .map_err(|_| format!("FROM_WORKERS_PER_S={v:?}: expected a whole number of POSTs a second"))?,
        Err(_) => 20,
    };
    println!("the workers' POST budget: {per_s} a second each (FROM_WORKERS_PER_S)");
    let mut runs: [Vec<(WrkResult, f64)>; 4] = Default::default();
    let mut batches: [Vec<f64>; 4] = Default::default();
    for side in [0usize, 1, 2, 3, 3, 2, 1, 0].repeat(rounds.max(1)) {
        let listen = [
            kvroute_wasm_tests::envoy::free_port(),
            kvroute_wasm_tests::envoy::free_port(),
        ];
        let cluster: String = fragment
            .lines()
            .filter(|l| !l.starts_with('#'))
            .collect::<Vec<_>>()
            .join("\n")
            .replace("port_value: 10100", &format!("port_value: {}", listen[0]))
            .replace("port_value: 10200", &format!("port_value: {}", listen[1]));
        let edit = move |t: String| {
            if side == 0 {
                return t;
            }
            let share = format!(
                r#""policy": "cost", "share": {{"replicas": {{"peers": ["127.0.0.1:{}", "127.0.0.1:{}"], "secret": "bench-replicas-secret-0123", "at_once": {}, "from_workers": {}, "from_workers_per_s": {per_s}}}}},"#,
                listen[0],
                listen[1],
                side >= 2,
                side == 3
            );
            t.replacen("\"policy\": \"cost\",", &share, 1).replacen(
                "  clusters:\n",
                &format!("  clusters:\n{cluster}\n"),
                1,
            )
        };
        let a = Envoy::start_listening("bench-overhead.yaml", &ports, 2, Some(listen[0]), edit.clone())?;
        let b = Envoy::start_listening("bench-overhead.yaml", &ports, 2, Some(listen[1]), edit)?;
        std::thread::sleep(Duration::from_millis(600));
        wrk_path(&a, a.port, "/v1/chat/completions", &script, 8, 2)?;
        let posts =
            || a.stat("wasmcustom.kvroute.replicas.batches_sent") + a.stat("wasmcustom.kvroute.replicas.direct_sent");
        let sent0 = posts();
        let b0 = process_cpu_s(b.pid()).ok_or("cannot read B's CPU time")?;
        let run = wrk_path(&a, a.port, "/v1/chat/completions", &script, 8, SECONDS as u32)?;
        let b_cpu = process_cpu_s(b.pid()).ok_or("cannot read B's CPU time")? - b0;
        let receiver_us = b_cpu * 1e6 / (run.rps * SECONDS).max(1.0);
        if side != 0 && b.stat("wasmcustom.kvroute.replicas.events_taken") == 0 {
            return Err(format!("B took nothing from A:\n{}", a.log_text()));
        }
        if side == 3 && a.stat("wasmcustom.kvroute.replicas.direct_sent") == 0 {
            return Err(format!("A's workers sent nothing themselves:\n{}", a.log_text()));
        }
        batches[side].push(posts().saturating_sub(sent0) as f64 / SECONDS);
        runs[side].push((run, receiver_us));
    }
    let sorted = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v
    };
    let mid = |v: &[f64]| v[v.len() / 2];
    let sender = [0, 1, 2, 3].map(|i| sorted(runs[i].iter().map(|(r, _)| r.envoy_cpu_us).collect()));
    let receiver = [0, 1, 2, 3].map(|i| sorted(runs[i].iter().map(|(_, b)| *b).collect()));
    let both = [0, 1, 2, 3].map(|i| sorted(runs[i].iter().map(|(r, b)| r.envoy_cpu_us + b).collect()));
    println!(
        "{} runs per side{}; medians [min–max], per request of A's traffic\n",
        sender[0].len(),
        if unique { ", every prompt a new prefix" } else { "" }
    );
    println!("| 1 KiB, 8 connections, 2 workers | A (sender) CPU/req | B (receiver) CPU/req | both | added | POSTs a second | req/s |");
    println!("|---|---|---|---|---|---|---|");
    for (i, label) in [
        "no replicas",
        "one peer, every 5 ms",
        "one peer, at once",
        "one peer, from the workers",
    ]
    .iter()
    .enumerate()
    {
        let (a, b, t) = (&sender[i], &receiver[i], &both[i]);
        println!(
            "| {label} | {:.1} µs [{:.1}–{:.1}] | {:.1} µs [{:.1}–{:.1}] | {:.1} µs | {:+.1} µs | {:.0} | {:.0} |",
            mid(a),
            a[0],
            a[a.len() - 1],
            mid(b),
            b[0],
            b[b.len() - 1],
            mid(t),
            mid(t) - mid(&both[0]),
            mid(&sorted(batches[i].clone())),
            mid(&sorted(runs[i].iter().map(|(r, _)| r.rps).collect()))
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
