//! The `replay` subcommand: policies compared on a workload in virtual time (see
//! `kvroute_sim::replay`).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use kvroute_sim::plan::Prices;
use kvroute_sim::policies::PolicyName;
use kvroute_sim::profile::{Gpu, Profile};
use kvroute_sim::replay::{self, ReplaySetup};
use kvroute_sim::report::cost::{self, RunCost};
use kvroute_sim::report::{self, RunReport};

use crate::{ClassArgs, FleetArgs, RouterArgs, TopologyArgs, WorkloadArgs};

#[derive(Args)]
pub struct ReplayArgs {
    #[command(flatten)]
    workload: WorkloadArgs,
    #[command(flatten)]
    fleet: FleetArgs,
    #[command(flatten)]
    topology: TopologyArgs,
    /// Policies to compare, comma-separated.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "round-robin,least-request,kvroute"
    )]
    policy: Vec<PolicyName>,
    #[command(flatten)]
    router: RouterArgs,
    /// One server slows down mid-run: `SERVER:FACTOR@SECONDS`, e.g. `0:3@60` (server 0's
    /// steps take 3× as long from 60 s on).
    #[arg(long)]
    slow: Option<String>,
    /// A server joins the pool mid-run: `SERVER@SECONDS`, e.g. `7@30` (server 7 is out of
    /// the pool until 30 s: no router knows it, nothing scrapes it). Repeatable.
    #[arg(long)]
    join: Vec<String>,
    /// A server leaves the pool mid-run: `SERVER@SECONDS`, e.g. `0@30` (from 30 s on no
    /// router sends it anything; what it is running finishes). Repeatable.
    #[arg(long)]
    leave: Vec<String>,
    /// Write the runs as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// With --json: every run also lists each completed request, one record each (its
    /// server as numbered in the fleet, arrival, TTFT, cached and reachable tokens, hold
    /// wait, ...); with --replicas, each replica's run in `replica_runs` lists its own.
    #[arg(long, requires = "json")]
    records: bool,
    /// Write an SVG plot (TTFT CDF per policy, per-server load).
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Also report the cold start (requests arriving in the first S seconds, while the
    /// caches fill) and the steady state (the rest) apart; with --price, the steady
    /// state's cost and objective too.
    #[arg(long)]
    cold_s: Option<f64>,
    /// Runs per policy: the workload as given plus perturbed copies (jittered arrivals,
    /// router seed + k, as in `matrix`); the tables show medians.
    #[arg(long, default_value_t = 1)]
    replicas: u64,
    #[command(flatten)]
    classes: ClassArgs,
    /// USD per GPU-hour of each GPU type in the fleet, e.g. `h100-80g=3.00,a100-80g=1.30`:
    /// adds each policy's cost per million tokens (input + output), the share of requests
    /// that met `--ttft-slo-ms` and each GPU type's share of the requests.
    #[arg(long)]
    price: Option<String>,
}

pub fn replay_cmd(a: &ReplayArgs) -> anyhow::Result<()> {
    let (name, requests) = a.workload.load()?;
    anyhow::ensure!(!requests.is_empty(), "the workload has no requests");
    anyhow::ensure!(a.replicas >= 1, "--replicas must be at least 1");
    if let Some(cold_s) = a.cold_s {
        anyhow::ensure!(cold_s > 0.0, "--cold-s must be positive");
    }
    let setup = setup(a)?;
    let prices = a.price.as_deref().map(|spec| parse_prices(spec, &setup)).transpose()?;
    let span_s = requests.iter().map(|r| r.arrival_ms).fold(0.0, f64::max) / 1000.0;
    describe(a, &name, &setup, requests.len(), span_s);
    replay::check_restart(&setup.topology, &requests)?;
    if let Some(cold_s) = a.cold_s {
        anyhow::ensure!(
            cold_s < span_s,
            "--cold-s {cold_s} leaves no steady state: the last request arrives at {span_s:.1} s"
        );
    }
    let mut runs: Vec<RunReport> = a.policy.iter().map(|p| run_one(&setup, *p, &requests)).collect();
    let extra = kvroute_sim::matrix::replica_runs(&setup, &a.policy, &requests, 1, a.replicas);
    let replicas: Vec<Vec<RunReport>> = runs
        .iter()
        .zip(extra)
        .map(|(r0, rest)| std::iter::once(r0.clone()).chain(rest).collect())
        .collect();
    for (policy, rs) in a.policy.iter().zip(&replicas) {
        for c in &setup.pool_changes {
            print_pool_change(&policy.to_string(), c, rs);
        }
    }
    let medians = |f: &dyn Fn(&RunReport) -> RunReport| -> Vec<RunReport> {
        replicas
            .iter()
            .map(|rs| RunReport::median_of(&rs.iter().map(f).collect::<Vec<_>>()))
            .collect()
    };
    if a.replicas > 1 {
        runs = medians(&|r| r.clone());
        println!(
            "medians of {} replicas (the workload and {} perturbed copies):",
            a.replicas,
            a.replicas - 1
        );
    }
    print!("{}", report::table(&runs));
    let mut costs = serde_json::Value::Null;
    if let Some(prices) = &prices {
        costs = print_costs(&setup, prices, &replicas, a.classes.ttft_slo_ms);
    }
    let mut classes = serde_json::Value::Null;
    if setup.classes.is_some() || replicas.iter().flatten().any(|r| !r.rejections.is_empty()) {
        // After a restart only the requests arriving from then on are reported.
        let restart_s = setup.topology.restart_at_ms.unwrap_or(0.0) / 1000.0;
        classes = print_classes(&replicas, a.classes.ttft_slo_ms, (span_s - restart_s).max(1e-3));
    }
    let mut phases = serde_json::Value::Null;
    if let Some(cold_s) = a.cold_s {
        let cut = cold_s * 1000.0;
        let cold = medians(&|r| r.phase(f64::MIN, cut));
        // Each replica's steady state, kept for its cost below.
        let steady_runs: Vec<Vec<RunReport>> = replicas
            .iter()
            .map(|rs| rs.iter().map(|r| r.phase(cut, f64::MAX)).collect())
            .collect();
        let steady: Vec<RunReport> = steady_runs.iter().map(|rs| RunReport::median_of(rs)).collect();
        println!(
            "cold start: requests arriving in the first {cold_s} s (evictions in that time; preemptions are not split by phase: 0)"
        );
        print!("{}", report::table(&cold));
        println!("steady state: requests arriving after {cold_s} s (evictions from then on; preemptions not split: 0)");
        print!("{}", report::table(&steady));
        phases = serde_json::json!({ "cold_s": cold_s, "cold": cold, "steady": steady });
        if let Some(prices) = &prices {
            // The cost of the steady state alone: its tokens over its own span (its first
            // arrival to its last finish), its requests' objective.
            println!("steady state's cost:");
            phases["steady_cost"] = print_costs(&setup, prices, &steady_runs, a.classes.ttft_slo_ms);
        }
    }
    if let Some(path) = &a.json {
        let mut doc = serde_json::json!({ "workload": name, "runs": runs, "phases": phases });
        if !costs.is_null() {
            doc["cost"] = costs;
        }
        if !classes.is_null() {
            doc["classes"] = classes;
        }
        if a.replicas > 1 {
            doc["replicas"] = serde_json::json!(a.replicas);
            doc["replica_runs"] = serde_json::json!(replicas);
        }
        if a.records {
            // With one replica `runs` are the runs themselves; otherwise they are medians
            // and each replica's run carries its own.
            for (i, rs) in replicas.iter().enumerate() {
                if a.replicas > 1 {
                    for (k, run) in rs.iter().enumerate() {
                        doc["replica_runs"][i][k]["records"] = serde_json::to_value(&run.records)?;
                    }
                } else if let Some(run) = rs.first() {
                    doc["runs"][i]["records"] = serde_json::to_value(&run.records)?;
                }
            }
        }
        std::fs::write(path, serde_json::to_string_pretty(&doc)? + "\n")
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    if let Some(path) = &a.plot {
        std::fs::write(path, report::svg(&format!("{name}: {} servers", setup.servers), &runs))
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

/// `--price` for the fleet `setup` describes: every GPU type in it priced.
fn parse_prices(spec: &str, setup: &ReplaySetup) -> anyhow::Result<Prices> {
    let gpus: Vec<Gpu> = servers(setup).iter().map(|p| p.gpu).collect();
    Prices::parse(spec, &gpus).map_err(anyhow::Error::msg)
}

/// One profile per server, in server order.
fn servers(setup: &ReplaySetup) -> Vec<Profile> {
    (0..setup.servers).map(|i| setup.profile_of(i)).collect()
}

/// Each policy's cost and objective (medians over its replicas), printed; returned as JSON.
fn print_costs(
    setup: &ReplaySetup,
    prices: &Prices,
    replicas: &[Vec<RunReport>],
    ttft_objective_ms: f64,
) -> serde_json::Value {
    let servers = servers(setup);
    let costs: Vec<RunCost> = replicas
        .iter()
        .map(|rs| {
            let each: Vec<RunCost> = rs
                .iter()
                .map(|r| cost::run_cost(r, &servers, prices, ttft_objective_ms))
                .collect();
            cost::median_cost(&each)
        })
        .collect();
    let usd_per_hour = cost::fleet_usd_per_hour(&servers, prices);
    print!("{}", cost::table(&costs, prices, usd_per_hour, ttft_objective_ms));
    let priced: std::collections::BTreeMap<String, f64> = prices
        .iter()
        .map(|(g, p)| (kvroute_sim::plan::gpu_name(*g), *p))
        .collect();
    serde_json::json!({
        "usd_per_gpu_hour": priced,
        "fleet_usd_per_hour": usd_per_hour,
        "ttft_objective_ms": ttft_objective_ms,
        "runs": costs,
    })
}

/// The fleet, router, topology, classes and pool changes the arguments describe.
fn setup(a: &ReplayArgs) -> anyhow::Result<ReplaySetup> {
    let router_config = a.router.config()?;
    let (profile, servers, mixed) = a.fleet.fleet()?;
    let pool_changes: Vec<replay::PoolChange> = a
        .join
        .iter()
        .map(|spec| parse_pool_change("--join", spec, true))
        .chain(a.leave.iter().map(|spec| parse_pool_change("--leave", spec, false)))
        .collect::<anyhow::Result<_>>()?;
    replay::check_pool_changes(servers, &pool_changes)?;
    Ok(ReplaySetup {
        profile,
        servers,
        mixed,
        slowdown: a.slow.as_deref().map(parse_slowdown).transpose()?,
        scrape_interval_ms: a.router.scrape_interval_ms()?,
        seed: a.workload.seed,
        router_config,
        topology: a.topology.topology()?,
        classes: a.classes.classes()?,
        pool_changes,
    })
}

/// One line on stderr: the workload and the fleet it runs on.
fn describe(a: &ReplayArgs, name: &str, setup: &ReplaySetup, requests: usize, span_s: f64) {
    if setup.mixed.is_empty() {
        eprintln!(
            "{name}: {requests} requests over {span_s:.0} s on {} × {} on {:?} (TP{}), {} KV blocks each",
            setup.servers, setup.profile.model, setup.profile.gpu, setup.profile.tp, setup.profile.num_gpu_blocks
        );
    } else {
        eprintln!(
            "{name}: {requests} requests over {span_s:.0} s on a mixed fleet of {} servers ({})",
            setup.servers,
            a.fleet.fleet.as_deref().unwrap_or("")
        );
    }
}

/// Replays the workload once under `policy` with a progress bar, then says on stderr how
/// fast it ran and, with a slowdown, the slowed server's share around it.
fn run_one(setup: &ReplaySetup, policy: PolicyName, requests: &[kvroute_sim::workload::SimRequest]) -> RunReport {
    let bar = ProgressBar::new(requests.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("{prefix:>18} [{bar:30}] {pos}/{len} {elapsed}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_prefix(policy.to_string());
    let started = Instant::now();
    let mut run = replay::run(setup, policy, requests, &|n| bar.set_position(n));
    run.sim_wall_s = (started.elapsed().as_secs_f64() * 1000.0).round() / 1000.0;
    bar.finish_and_clear();
    let simulated_s = requests.iter().map(|r| r.arrival_ms).fold(0.0, f64::max) / 1000.0;
    eprintln!(
        "{policy}: {:.2} s wall, {:.0}× faster than real time",
        run.sim_wall_s,
        simulated_s / run.sim_wall_s.max(1e-9)
    );
    if let Some(slow) = setup.slowdown {
        let at = slow.at_ms;
        let shares: Vec<String> = [
            (-10_000.0, 0.0),
            (0.0, 1000.0),
            (1000.0, 2000.0),
            (2000.0, 5000.0),
            (5000.0, 15_000.0),
        ]
        .iter()
        .map(|(a, b)| format!("{:.1}%", 100.0 * run.share_between(slow.server, at + a, at + b)))
        .collect();
        eprintln!(
            "{policy}: server {} (slowed {}× at {:.0} s) share: 10 s before {}, first second after {}, 1–2 s {}, 2–5 s {}, 5–15 s {}",
            slow.server,
            slow.factor,
            at / 1000.0,
            shares[0],
            shares[1],
            shares[2],
            shares[3],
            shares[4]
        );
    }
    run
}

/// The per-class table and each policy's goodput, printed; returned as JSON.
fn print_classes(replicas: &[Vec<RunReport>], ttft_slo_ms: f64, span_s: f64) -> serde_json::Value {
    let (text, json) = kvroute_sim::overload::summary(replicas, ttft_slo_ms, span_s);
    print!("{text}");
    json
}

/// `SERVER@SECONDS`.
fn parse_pool_change(flag: &str, spec: &str, joins: bool) -> anyhow::Result<replay::PoolChange> {
    let bad = || anyhow::anyhow!("{flag} {spec:?}: expected SERVER@SECONDS, e.g. 7@30");
    let (server, at) = spec.split_once('@').ok_or_else(bad)?;
    let at_s: f64 = at.trim().parse().map_err(|_| bad())?;
    anyhow::ensure!(
        at_s.is_finite() && at_s >= 0.0,
        "{flag} {spec:?}: the time must be 0 s or later"
    );
    Ok(replay::PoolChange {
        server: server.trim().parse().map_err(|_| bad())?,
        at_ms: at_s * 1000.0,
        joins,
    })
}

/// What a pool change did, as medians over the replicas: the server's share of the
/// completed requests that arrived in windows after it (a joining server's ramp; a leaving
/// one's is 0), and TTFT p95, the reachable hit rate and the captured share of it of the
/// arrivals in the 10 s before and after (a captured share means little where almost
/// nothing is reachable).
fn print_pool_change(policy: &str, c: &replay::PoolChange, runs: &[RunReport]) {
    let at = c.at_ms;
    let median = |f: &dyn Fn(&RunReport) -> f64| kvroute_sim::matrix::median(runs.iter().map(f).collect());
    let shares: Vec<String> = [(0.0, 1000.0), (1000.0, 2000.0), (2000.0, 5000.0), (5000.0, 15_000.0)]
        .iter()
        .map(|(a, b)| format!("{:.1}%", 100.0 * median(&|r| r.share_between(c.server, at + a, at + b))))
        .collect();
    let before = |r: &RunReport| r.phase(at - 10_000.0, at);
    let after = |r: &RunReport| r.phase(at, at + 10_000.0);
    println!(
        "{policy}: server {} {} at {:.0} s (medians of {}); its share of arrivals: first second {}, \
         1–2 s {}, 2–5 s {}, 5–15 s {}; arrivals 10 s before / after: TTFT p95 {:.0} / {:.0} ms, \
         reachable hit rate {:.1}% / {:.1}%, captured reuse {:.1}% / {:.1}%",
        c.server,
        if c.joins { "joined" } else { "left" },
        at / 1000.0,
        runs.len(),
        shares[0],
        shares[1],
        shares[2],
        shares[3],
        median(&|r| before(r).ttft_ms.p95),
        median(&|r| after(r).ttft_ms.p95),
        100.0 * median(&|r| before(r).reachable_hit_rate),
        100.0 * median(&|r| after(r).reachable_hit_rate),
        100.0 * median(&|r| before(r).captured_reuse),
        100.0 * median(&|r| after(r).captured_reuse),
    );
}

/// `SERVER:FACTOR@SECONDS`.
fn parse_slowdown(spec: &str) -> anyhow::Result<replay::Slowdown> {
    let bad = || anyhow::anyhow!("--slow {spec:?}: expected SERVER:FACTOR@SECONDS, e.g. 0:3@60");
    let (server, rest) = spec.split_once(':').ok_or_else(bad)?;
    let (factor, at) = rest.split_once('@').ok_or_else(bad)?;
    let slowdown = replay::Slowdown {
        server: server.trim().parse().map_err(|_| bad())?,
        factor: factor.trim().parse().map_err(|_| bad())?,
        at_ms: at.trim().parse::<f64>().map_err(|_| bad())? * 1000.0,
    };
    anyhow::ensure!(slowdown.factor >= 1.0, "--slow {spec:?}: the factor must be at least 1");
    Ok(slowdown)
}
