//! The `plan` subcommand: per policy and GPU type, the smallest fleet that meets a latency
//! objective on a workload, with its cost (see `kvroute_sim::plan`).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use kvroute_core::Config;
use kvroute_sim::plan::mix::{self, Mix, MixTask};
use kvroute_sim::plan::{self, chart, Objective, Planner, Prices, Sizing};
use kvroute_sim::policies::PolicyName;
use kvroute_sim::profile::{Gpu, Model, Profile};
use kvroute_sim::replay::ReplaySetup;

use crate::{RouterArgs, TopologyArgs, WorkloadArgs};

/// Fleets are homogeneous: each GPU type is sized on its own (`--tp` GPUs per server, every
/// server alike); `--mix` sizes fleets of two GPU types instead.
#[derive(Args)]
pub struct PlanArgs {
    #[command(flatten)]
    workload: WorkloadArgs,
    /// The objective: `ttft_p95=DURATION[,itl_p95=DURATION]`, in ms or s (e.g.
    /// `ttft_p95=500ms,itl_p95=50ms`). A size also fails when more than 1% of its requests
    /// do not complete.
    #[arg(long)]
    objective: Objective,
    /// Judge the objective on the requests arriving after this many seconds: the steady
    /// state, the first fill of the caches left out (as `replay --cold-s` splits a run).
    /// Failed requests still count against it; the cost stays the whole run's. Default:
    /// the whole run, cold start included.
    #[arg(long)]
    cold_s: Option<f64>,
    /// GPU types to size, comma-separated; each is sized as a fleet of its own.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "h100-80g")]
    gpu: Vec<Gpu>,
    /// Size fleets of two GPU types instead, `CHEAP,PREMIUM` (e.g. `a100-80g,h100-80g`): for
    /// each count of the cheap type (0, 1, 2, …), the fewest servers of the premium type with
    /// which the fleet meets the objective, and the cheapest such fleet per hour. Only fleets
    /// cheaper than the best found so far are replayed.
    #[arg(long, value_enum, value_delimiter = ',', conflicts_with = "gpu")]
    mix: Vec<Gpu>,
    /// With `--mix`: also size kvroute with the premium servers as its price tier 1 (`tiers`:
    /// the objective's TTFT as the tiers' objective and each type's sequence slots, unless
    /// `--router-config` sets them), next to the policies.
    #[arg(long, requires = "mix")]
    tiered: bool,
    /// With `--mix`: the most servers of the cheap type tried (default: --max-servers).
    #[arg(long, requires = "mix")]
    max_cheap: Option<usize>,
    /// USD per GPU-hour of every GPU in --gpu: `h100-80g=2.49,a100-80g=1.29`.
    #[arg(long)]
    price: String,
    #[arg(long, value_enum, default_value = "llama-3.1-8b")]
    model: Model,
    /// GPUs per server (tensor parallelism).
    #[arg(long, default_value_t = 1)]
    tp: u32,
    /// Blocks become prefix-cache hits when their step ends (the engine of the figures
    /// published before 2026-11-28), not when it is planned as vLLM V1 caches them.
    #[arg(long)]
    cache_at_finish: bool,
    /// Policies to size, comma-separated.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "round-robin,least-request,kvroute"
    )]
    policy: Vec<PolicyName>,
    /// The largest fleet (servers) tried; with `--mix`, the most servers of the premium type.
    #[arg(long, default_value_t = 64)]
    max_servers: usize,
    /// Replays per fleet size: the workload plus perturbed copies (jittered arrivals); a
    /// size passes when most of them meet the objective, figures are medians.
    #[arg(long, default_value_t = 1)]
    replicas: u64,
    /// Replay every size to the end, even once it can no longer meet the objective (exact
    /// attainment for every point of the chart; slower).
    #[arg(long)]
    no_early_stop: bool,
    /// Searches (policy × GPU) run at once (default: the machine's cores); when there are
    /// more than searches, each size's replicas also run in parallel.
    #[arg(long)]
    jobs: Option<usize>,
    #[command(flatten)]
    router: RouterArgs,
    #[command(flatten)]
    topology: TopologyArgs,
    /// Write every evaluated point as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write an SVG plot of objective attainment against fleet size.
    #[arg(long)]
    plot: Option<PathBuf>,
}

pub fn plan_cmd(a: &PlanArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.max_servers >= 1, "--max-servers must be at least 1");
    anyhow::ensure!(a.replicas >= 1, "--replicas must be at least 1");
    anyhow::ensure!(
        !a.policy.is_empty() && !a.gpu.is_empty(),
        "give at least one --policy and one --gpu"
    );
    let scrape_interval_ms = a.router.scrape_interval_ms()?;
    let gpus = if a.mix.is_empty() { &a.gpu } else { &a.mix };
    let prices = Prices::parse(&a.price, gpus).map_err(anyhow::Error::msg)?;
    let profiles = gpus
        .iter()
        .map(|g| Ok(Profile::new(*g, a.model, a.tp)?.with_cache_at_schedule(!a.cache_at_finish)))
        .collect::<anyhow::Result<Vec<Profile>>>()?;
    let (name, requests) = a.workload.load()?;
    anyhow::ensure!(!requests.is_empty(), "the workload has no requests");
    let last_s = requests.iter().map(|r| r.arrival_ms).fold(0.0, f64::max) / 1000.0;
    if let Some(c) = a.cold_s {
        anyhow::ensure!(
            c.is_finite() && c > 0.0,
            "--cold-s must be a positive number of seconds"
        );
        anyhow::ensure!(
            c < last_s,
            "--cold-s {c} leaves no steady state: the last request arrives at {last_s:.1} s"
        );
    }
    let config_bytes = a.router.config_bytes()?;
    let router_config = Config::from_json(&config_bytes)?;
    let jobs = a
        .jobs
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    anyhow::ensure!(jobs >= 1, "--jobs must be at least 1");
    let planner = Planner {
        base: ReplaySetup {
            classes: None,
            pool_changes: Vec::new(),
            profile: profiles[0].clone(),
            servers: 1,
            mixed: Vec::new(),
            slowdown: None,
            scrape_interval_ms,
            seed: a.workload.seed,
            router_config,
            topology: {
                let t = a.topology.topology()?;
                anyhow::ensure!(t.restart_at_ms.is_none(), "plan does not take --restart-at-s");
                t
            },
        },
        requests: &requests,
        objective: a.objective,
        replicas: a.replicas,
        early_stop: !a.no_early_stop,
        // Searches first (each is sequential); spare cores replay a size's replicas at once.
        parallel_replicas: jobs > searches(a),
        cold_ms: a.cold_s.map_or(0.0, |c| c * 1000.0),
    };
    if !a.mix.is_empty() {
        return mix_cmd(a, &name, &planner, &profiles, &prices, &config_bytes, jobs);
    }
    eprintln!(
        "{name}: {} requests over {last_s:.0} s; {}; {} servers at most, {} replica(s) per size, {} searches at once",
        requests.len(),
        objective_text(a),
        a.max_servers,
        a.replicas,
        jobs.min(searches(a))
    );
    let started = Instant::now();
    let sizings: Vec<_> = planner
        .size_all(&a.policy, &profiles, a.max_servers, jobs, &|m| eprintln!("  {m}"))
        .into_iter()
        .map(|s| {
            let price = prices.of(s.gpu);
            s.priced(price)
        })
        .collect();
    let wall_s = started.elapsed().as_secs_f64();
    let evaluated: usize = sizings.iter().map(|s| s.points.len()).sum();
    eprintln!("{evaluated} fleet sizes evaluated in {wall_s:.0} s");
    print_and_write(a, &name, requests.len(), &prices, &sizings, wall_s)
}

/// The objective and the requests it is judged on.
fn objective_text(a: &PlanArgs) -> String {
    let judged = match a.cold_s {
        Some(c) => format!("in steady state (requests arriving after {c} s)"),
        None => "over the whole run (cold start included)".to_string(),
    };
    format!("{} {judged}", chart::objective_text(&a.objective))
}

/// How many searches the command runs: each policy on each GPU type, or on the mix (and
/// kvroute tiered).
fn searches(a: &PlanArgs) -> usize {
    if a.mix.is_empty() {
        a.policy.len() * a.gpu.len()
    } else {
        a.policy.len() + usize::from(a.tiered)
    }
}

/// `--mix`: each policy's cheapest fleet of the two GPU types (`plan::mix`).
fn mix_cmd(
    a: &PlanArgs,
    name: &str,
    planner: &Planner,
    profiles: &[Profile],
    prices: &Prices,
    config_bytes: &[u8],
    jobs: usize,
) -> anyhow::Result<()> {
    let [cheap, premium] = profiles else {
        anyhow::bail!("--mix takes two GPU types, the cheap one first: e.g. --mix a100-80g,h100-80g");
    };
    anyhow::ensure!(
        cheap.gpu != premium.gpu,
        "--mix takes two different GPU types (one type is sized without --mix)"
    );
    anyhow::ensure!(
        a.plot.is_none(),
        "--plot draws homogeneous sizings: leave it out with --mix"
    );
    let config_json: serde_json::Value = if config_bytes.iter().all(u8::is_ascii_whitespace) {
        serde_json::json!({})
    } else {
        serde_json::from_slice(config_bytes)?
    };
    if a.tiered {
        // Only the tier's endpoints change from fleet to fleet: a configuration that fails
        // here fails for all of them.
        mix::tiered_config(&config_json, cheap, premium, 1, 1, &a.objective).map_err(anyhow::Error::msg)?;
    }
    let mut tasks: Vec<MixTask> = a
        .policy
        .iter()
        .map(|p| MixTask {
            policy: *p,
            tiered: false,
        })
        .collect();
    if a.tiered {
        tasks.push(MixTask {
            policy: PolicyName::Kvroute,
            tiered: true,
        });
    }
    let mix = Mix {
        cheap,
        premium,
        cheap_usd_per_gpu_hour: prices.of(cheap.gpu),
        premium_usd_per_gpu_hour: prices.of(premium.gpu),
        max_premium: a.max_servers,
        max_cheap: a.max_cheap.unwrap_or(a.max_servers),
        config_json: &config_json,
    };
    let (cn, pn) = (plan::gpu_name(cheap.gpu), plan::gpu_name(premium.gpu));
    eprintln!(
        "{name}: {} requests; {}; {cn} + {pn}, up to {} and {} servers, {} replica(s) per fleet, {} searches at once",
        planner.requests.len(),
        objective_text(a),
        mix.max_cheap,
        mix.max_premium,
        a.replicas,
        jobs.min(tasks.len())
    );
    let started = Instant::now();
    let sizings = planner.size_mixes(&tasks, &mix, jobs, &|m| eprintln!("  {m}"));
    let wall_s = started.elapsed().as_secs_f64();
    let evaluated: usize = sizings.iter().map(|s| s.evaluated.len()).sum();
    eprintln!("{evaluated} fleets evaluated in {wall_s:.0} s");
    println!(
        "{name}: the cheapest fleet of {cn} and {pn} servers meeting {} ({}, tp {}); for each count of {cn}, the fewest {pn} that meet it",
        objective_text(a),
        a.model.served_name(),
        a.tp
    );
    print!("{}", mix::table(&sizings, cheap, premium));
    println!(
        "($/hour: servers × tp × $/GPU-hour; $/month: × 730 h. $/Mtok: $/hour × the replayed span, first arrival to last completion, ÷ millions of prompt + output tokens processed. within: the share of requests within the objective.)"
    );
    write_json(
        a,
        name,
        planner.requests.len(),
        prices,
        wall_s,
        serde_json::json!({
            "mix": [cn, pn],
            "max_cheap": mix.max_cheap,
            "max_premium": mix.max_premium,
            "sizings": sizings,
        }),
    )?;
    Ok(())
}

/// The table, the chart, and the JSON and SVG when asked for.
fn print_and_write(
    a: &PlanArgs,
    name: &str,
    requests: usize,
    prices: &Prices,
    sizings: &[Sizing],
    wall_s: f64,
) -> anyhow::Result<()> {
    println!(
        "{name}: the smallest fleet meeting {} ({}, tp {}; homogeneous fleets)",
        objective_text(a),
        a.model.served_name(),
        a.tp
    );
    print!("{}", chart::table(sizings, a.max_servers));
    println!(
        "($/month: GPUs × $/GPU-hour × 730 h. $/Mtok: GPUs × $/GPU-hour × the replayed span, first arrival to last completion, ÷ millions of prompt + output tokens processed; the fleet is assumed busy with this workload only.)\n"
    );
    print!("{}", chart::text_chart(sizings, &a.objective));
    write_json(
        a,
        name,
        requests,
        prices,
        wall_s,
        serde_json::json!({"max_servers": a.max_servers, "sizings": sizings}),
    )?;
    if let Some(path) = &a.plot {
        let title = format!("{name}: {}", objective_text(a));
        std::fs::write(path, chart::svg(&title, sizings, &a.objective))
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

/// `--json`, when asked for: the run's workload, objective and settings, and `found` (what
/// the search found and its own bounds).
fn write_json(
    a: &PlanArgs,
    name: &str,
    requests: usize,
    prices: &Prices,
    wall_s: f64,
    found: serde_json::Value,
) -> anyhow::Result<()> {
    let Some(path) = &a.json else {
        return Ok(());
    };
    let mut doc = serde_json::json!({
        "workload": name,
        "requests": requests,
        "objective": a.objective,
        "cold_s": a.cold_s,
        "max_failed_fraction": plan::MAX_FAILED,
        "model": clap::ValueEnum::to_possible_value(&a.model).map(|v| v.get_name().to_string()),
        "tp": a.tp,
        "prices_usd_per_gpu_hour": prices.iter().map(|(g, p)| (plan::gpu_name(*g), *p)).collect::<std::collections::BTreeMap<_, _>>(),
        "replicas": a.replicas,
        "early_stop": !a.no_early_stop,
        "wall_s": (wall_s * 10.0).round() / 10.0,
    });
    if let (Some(doc), serde_json::Value::Object(found)) = (doc.as_object_mut(), found) {
        doc.extend(found);
    }
    std::fs::write(path, serde_json::to_string_pretty(&doc)? + "\n")
        .with_context(|| format!("cannot write {}", path.display()))
}
