//! `kvroute-sim`: `replay` (virtual time), `serve` (live vLLM-compatible servers) and
//! `bench` (a load generator against a real gateway).

#![allow(clippy::disallowed_methods)] // the binary is the wall-time driver: it reads clocks

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use kvroute_core::Config;
use kvroute_sim::policies::PolicyName;
use kvroute_sim::profile::{Gpu, Model, Profile};
use kvroute_sim::replay::{self, ReplaySetup};
use kvroute_sim::report::{self, RunReport};
use kvroute_sim::workload::{self, GenParams, Generator, SimRequest, TraceFormat};

#[derive(Parser)]
#[command(
    name = "kvroute-sim",
    version,
    about = "A simulator of vLLM servers for testing and measuring kvroute"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Replay a workload on a simulated fleet in virtual time, once per policy.
    Replay(ReplayArgs),
}

#[derive(Args)]
pub struct WorkloadArgs {
    /// A trace file (see --format).
    #[arg(long, conflicts_with = "workload")]
    trace: Option<PathBuf>,
    #[arg(long, value_enum, default_value = "mooncake")]
    format: TraceFormat,
    /// Azure traces: give requests a shared prefix (half the context) from this many groups.
    #[arg(long, default_value_t = 0)]
    prefix_overlay: u64,
    /// A generated workload instead of a trace.
    #[arg(long, value_enum)]
    workload: Option<Generator>,
    /// Arrival rate of generated workloads, requests per second (default per workload).
    #[arg(long)]
    rate: Option<f64>,
    /// Multiplies the arrival rate (divides arrival times).
    #[arg(long, default_value_t = 1.0)]
    rate_scale: f64,
    /// Keep only the first N requests.
    #[arg(long)]
    limit: Option<usize>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

impl WorkloadArgs {
    pub fn load(&self) -> anyhow::Result<(String, Vec<SimRequest>)> {
        anyhow::ensure!(self.rate_scale > 0.0, "--rate-scale must be positive");
        let (name, mut reqs) = match (&self.trace, self.workload) {
            (Some(path), _) => {
                let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
                let reqs = match self.format {
                    TraceFormat::Mooncake => workload::parse_mooncake(&text)?,
                    TraceFormat::Azure => workload::parse_azure(&text, self.prefix_overlay, self.seed)?,
                };
                (
                    path.file_name()
                        .map_or("trace".into(), |n| n.to_string_lossy().to_string()),
                    reqs,
                )
            }
            (None, Some(g)) => {
                let mut p = GenParams::defaults(g);
                p.seed = self.seed;
                if let Some(rate) = self.rate {
                    anyhow::ensure!(rate > 0.0, "--rate must be positive");
                    p.rate = rate;
                }
                (g.to_string(), workload::generate(g, &p))
            }
            (None, None) => anyhow::bail!("give --trace FILE or --workload shared-prefix|multi-turn|rag"),
        };
        if let Some(n) = self.limit {
            reqs.truncate(n);
        }
        for r in &mut reqs {
            r.arrival_ms /= self.rate_scale;
        }
        Ok((name, reqs))
    }
}

#[derive(Args)]
pub struct FleetArgs {
    #[arg(long, default_value_t = 8)]
    servers: usize,
    #[arg(long, value_enum, default_value = "h100-80g")]
    gpu: Gpu,
    #[arg(long, value_enum, default_value = "llama-3.1-8b")]
    model: Model,
    #[arg(long, default_value_t = 1)]
    tp: u32,
}

impl FleetArgs {
    pub fn profile(&self) -> anyhow::Result<Profile> {
        anyhow::ensure!(self.servers >= 1, "--servers must be at least 1");
        Profile::new(self.gpu, self.model, self.tp)
    }
}

#[derive(Args)]
struct ReplayArgs {
    #[command(flatten)]
    workload: WorkloadArgs,
    #[command(flatten)]
    fleet: FleetArgs,
    /// Policies to compare, comma-separated.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "round-robin,least-request,kvroute"
    )]
    policy: Vec<PolicyName>,
    /// kvroute's JSON config (the filter's plugin configuration); defaults otherwise.
    #[arg(long)]
    router_config: Option<PathBuf>,
    #[arg(long, default_value_t = 200.0)]
    scrape_interval_ms: f64,
    /// Write the runs as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write an SVG plot (TTFT CDF per policy, per-server load).
    #[arg(long)]
    plot: Option<PathBuf>,
}

fn replay_cmd(a: &ReplayArgs) -> anyhow::Result<()> {
    let (name, requests) = a.workload.load()?;
    anyhow::ensure!(!requests.is_empty(), "the workload has no requests");
    let router_config = match &a.router_config {
        Some(p) => Config::from_json(&std::fs::read(p).with_context(|| format!("cannot read {}", p.display()))?)?,
        None => Config::from_json(b"")?,
    };
    anyhow::ensure!(a.scrape_interval_ms > 0.0, "--scrape-interval-ms must be positive");
    let setup = ReplaySetup {
        profile: a.fleet.profile()?,
        servers: a.fleet.servers,
        scrape_interval_ms: a.scrape_interval_ms,
        seed: a.workload.seed,
        router_config,
    };
    let span_s = requests.iter().map(|r| r.arrival_ms).fold(0.0, f64::max) / 1000.0;
    eprintln!(
        "{name}: {} requests over {span_s:.0} s on {} × {} on {:?} (TP{}), {} KV blocks each",
        requests.len(),
        setup.servers,
        setup.profile.model,
        setup.profile.gpu,
        setup.profile.tp,
        setup.profile.num_gpu_blocks
    );
    let mut runs: Vec<RunReport> = Vec::new();
    for policy in &a.policy {
        let bar = ProgressBar::new(requests.len() as u64);
        bar.set_style(
            ProgressStyle::with_template("{prefix:>18} [{bar:30}] {pos}/{len} {elapsed}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        bar.set_prefix(policy.to_string());
        let started = Instant::now();
        let mut run = replay::run(&setup, *policy, &requests, &|n| bar.set_position(n));
        run.sim_wall_s = (started.elapsed().as_secs_f64() * 1000.0).round() / 1000.0;
        bar.finish_and_clear();
        let simulated_s = requests.iter().map(|r| r.arrival_ms).fold(0.0, f64::max) / 1000.0;
        eprintln!(
            "{policy}: {:.2} s wall, {:.0}× faster than real time",
            run.sim_wall_s,
            simulated_s / run.sim_wall_s.max(1e-9)
        );
        runs.push(run);
    }
    print!("{}", report::table(&runs));
    if let Some(path) = &a.json {
        let doc = serde_json::json!({ "workload": name, "runs": runs });
        std::fs::write(path, serde_json::to_string_pretty(&doc)? + "\n")
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    if let Some(path) = &a.plot {
        std::fs::write(path, report::svg(&format!("{name}: {} servers", setup.servers), &runs))
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Replay(a) => replay_cmd(&a),
    }
}
