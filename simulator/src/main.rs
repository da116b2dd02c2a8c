//! `kvroute-sim`: `replay` (virtual time), `serve` (live vLLM-compatible servers) and
//! `bench` (a load generator against a real gateway), and on top of replay `matrix` and
//! `plan` (fleet sizing).

#![allow(clippy::disallowed_methods)] // the binary is the wall-time driver: it reads clocks

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use kvroute_sim::profile::{Gpu, Model, Profile};
use kvroute_sim::replay::Topology;
use kvroute_sim::report;
use kvroute_sim::workload::{self, GenParams, Generator, SimRequest, TraceFormat};

mod commands;
use commands::{compare_cmd, matrix_cmd, profiles_cmd, CompareArgs, MatrixArgs};
mod plan_cmd;
use plan_cmd::{plan_cmd, PlanArgs};
mod replay_cmd;
use replay_cmd::{replay_cmd, ReplayArgs};

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
    /// Run simulated vLLM servers as real HTTP servers (wall time).
    Serve(ServeArgs),
    /// Drive a workload through a real HTTP endpoint (e.g. Envoy) and measure it.
    Bench(BenchArgs),
    /// Print runs from several JSON reports side by side (and plot them).
    Compare(CompareArgs),
    /// Print the calibration of every GPU × model profile (step times, KV size).
    Profiles,
    /// The routing-quality matrix: workloads × loads × policies (replay), as Markdown + JSON.
    Matrix(MatrixArgs),
    /// Fleet sizing: per policy and GPU type, the smallest homogeneous fleet whose replay of
    /// the workload meets a latency objective, with $/month and $/million tokens.
    ///
    /// Each GPU type is sized as a fleet of its own (`--tp` GPUs per server, all alike), or,
    /// with `--mix CHEAP,PREMIUM`, the cheapest fleet of two types (`--tiered`: kvroute with
    /// the premium servers as its price tier).
    Plan(PlanArgs),
}

#[derive(Args)]
struct ServeArgs {
    #[command(flatten)]
    fleet: FleetArgs,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8001)]
    base_port: u16,
    /// Fault-injection admin port (default: base port − 1).
    #[arg(long)]
    admin_port: Option<u16>,
    /// Run this many times faster than real time (step durations are divided by it).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Export the pre-0.12 metric names.
    #[arg(long)]
    legacy_metrics: bool,
    /// Override the KV cache size in blocks (smaller fleets fill faster).
    #[arg(long)]
    num_gpu_blocks: Option<u64>,
    /// As vLLM's: refuse (503) a request that would take the unfinished sequences past this.
    #[arg(long)]
    max_num_queued_reqs: Option<u64>,
    /// As vLLM's: refuse (503) a request that would take the prompt tokens still in prefill
    /// past this.
    #[arg(long)]
    max_num_queued_tokens: Option<u64>,
    /// Keep Responses API responses for `previous_response_id` and `GET /v1/responses/{id}`,
    /// as vLLM does with VLLM_ENABLE_RESPONSES_API_STORE=1 (the default, from that variable:
    /// off when unset); `--responses-store=false` turns it off.
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    responses_store: Option<bool>,
    /// As vLLM's: every chat and completions stream reports its usage, at its end and on each
    /// chunk, whether or not the request set `stream_options.include_usage`.
    #[arg(long)]
    enable_force_include_usage: bool,
}

#[derive(Args)]
struct BenchArgs {
    #[command(flatten)]
    workload: WorkloadArgs,
    #[arg(long, default_value = "http://127.0.0.1:10000")]
    url: String,
    /// Send only requests arriving in the first S seconds.
    #[arg(long, default_value_t = 60.0)]
    duration: f64,
    #[arg(long, value_enum, default_value = "llama-3.1-8b")]
    model: Model,
    /// Name of this run in the table and JSON.
    #[arg(long, default_value = "live")]
    label: String,
    /// The API the prompts go through: `messages` sends them to `/v1/messages` as Claude
    /// Code does, with an attribution block whose hash differs on every request.
    #[arg(long, value_enum, default_value = "chat")]
    api: kvroute_sim::bench::Api,
    /// The servers' --time-scale: measured times are multiplied by it (and throughput
    /// divided) so figures are in simulated GPU time.
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Live, each request carries its class in kvroute's headers (`x-kvroute-tenant`,
    /// `x-kvroute-priority`, `x-kvroute-ttft-objective-ms`), and a 429 from the gateway
    /// counts as a refusal, not a failure.
    #[command(flatten)]
    classes: ClassArgs,
    #[arg(long)]
    json: Option<PathBuf>,
}

/// The router under test (`replay`, `matrix`, `plan`): kvroute's configuration and how often
/// the routers read the servers' metrics.
#[derive(Args)]
pub struct RouterArgs {
    /// kvroute's JSON config (the filter's plugin configuration); defaults otherwise.
    #[arg(long)]
    router_config: Option<PathBuf>,
    /// How often routers read the servers' metrics, in ms (gie-weighted always every 50 ms,
    /// the endpoint picker's default refresh; sglang-cache-aware every 10 s).
    #[arg(long, default_value_t = 200.0)]
    scrape_interval_ms: f64,
}

impl RouterArgs {
    /// The config file's bytes, empty without `--router-config`.
    pub fn config_bytes(&self) -> anyhow::Result<Vec<u8>> {
        match &self.router_config {
            Some(p) => std::fs::read(p).with_context(|| format!("cannot read {}", p.display())),
            None => Ok(Vec::new()),
        }
    }

    /// kvroute's configuration: the file's, or the defaults.
    pub fn config(&self) -> anyhow::Result<kvroute_core::Config> {
        Ok(kvroute_core::Config::from_json(&self.config_bytes()?)?)
    }

    /// The scrape interval, refused unless positive and finite.
    pub fn scrape_interval_ms(&self) -> anyhow::Result<f64> {
        let ms = self.scrape_interval_ms;
        anyhow::ensure!(
            ms.is_finite() && ms > 0.0,
            "--scrape-interval-ms must be positive (got {ms})"
        );
        Ok(ms)
    }
}

/// Request classes for overload runs (`replay`, `bench`): which tenant sent each request, its
/// priority band and the band's TTFT objective (`kvroute_sim::replay::Classes`).
#[derive(Args)]
pub struct ClassArgs {
    /// Tenants' shares of the prefix families, e.g. `0.7,0.1,0.1,0.1` (a tenant owns whole
    /// families); a per-class table follows (see `overload`).
    #[arg(long)]
    tenants: Option<String>,
    /// Priority bands and their shares of the requests, `PRIORITY:SHARE,…`, e.g.
    /// `1:0.2,0:0.7,-1:0.1` (negative: sheddable, as kvroute's priority header).
    #[arg(long)]
    priorities: Option<String>,
    /// Each priority band's TTFT objective, `PRIORITY:MS,…`, e.g. `1:2000,0:10000,-1:30000`:
    /// its requests send it (kvroute's `tiers.objective_header`, which `overload.hold.
    /// objective_wait_share` reads) and count as goodput within it; bands not listed send none
    /// and count within `--ttft-slo-ms`.
    #[arg(long)]
    objectives: Option<String>,
    /// The TTFT objective: a completion within it counts as goodput in the per-class table,
    /// and as meeting the objective in `replay`'s cost lines (`--price`).
    #[arg(long, default_value_t = 2000.0)]
    pub ttft_slo_ms: f64,
}

impl ClassArgs {
    /// The classes asked for, if any.
    pub fn classes(&self) -> anyhow::Result<Option<kvroute_sim::replay::Classes>> {
        if (&self.tenants, &self.priorities, &self.objectives) == (&None, &None, &None) {
            return Ok(None);
        }
        let c = kvroute_sim::replay::Classes::parse(
            self.tenants.as_deref().unwrap_or("1"),
            self.priorities.as_deref().unwrap_or("0:1"),
        )?;
        Ok(Some(match &self.objectives {
            Some(o) => c.with_objectives(o)?,
            None => c,
        }))
    }
}

fn serve_cmd(a: &ServeArgs) -> anyhow::Result<()> {
    let (profile, n, mixed) = a.fleet.fleet()?;
    let mut profiles = if mixed.is_empty() { vec![profile; n] } else { mixed };
    if let Some(b) = a.num_gpu_blocks {
        profiles = profiles.into_iter().map(|p| p.with_blocks(b)).collect();
    }
    let admin = a.admin_port.unwrap_or(a.base_port.saturating_sub(1));
    let options = kvroute_sim::serve::Options {
        legacy: a.legacy_metrics,
        admission: kvroute_sim::serve::Admission {
            max_num_queued_reqs: a.max_num_queued_reqs,
            max_num_queued_tokens: a.max_num_queued_tokens,
        },
        responses_store: match a.responses_store {
            Some(on) => on,
            None => kvroute_sim::serve::responses_store_from_env()?,
        },
        force_include_usage: a.enable_force_include_usage,
    };
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        tokio::select! {
            r = kvroute_sim::serve::serve(profiles, &a.host, a.base_port, admin, a.time_scale, None, options) => r,
            _ = tokio::signal::ctrl_c() => Ok(()),
        }
    })
}

fn bench_cmd(a: &BenchArgs) -> anyhow::Result<()> {
    let (name, requests) = a.workload.load()?;
    let sent = requests.iter().filter(|r| r.arrival_ms <= a.duration * 1000.0).count();
    anyhow::ensure!(sent > 0, "no request arrives within --duration {} s", a.duration);
    eprintln!(
        "{name}: sending {sent} requests to {} over up to {} s",
        a.url, a.duration
    );
    let bar = ProgressBar::new(sent as u64);
    bar.set_style(
        ProgressStyle::with_template("{prefix:>10} [{bar:30}] {pos}/{len} {elapsed}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_prefix(a.label.clone());
    let b = bar.clone();
    let classes = a.classes.classes()?;
    anyhow::ensure!(
        classes.is_none() || a.time_scale == 1.0,
        "--tenants/--priorities/--objectives need --time-scale 1: the gateway judges objectives in wall time"
    );
    let per_request: Vec<kvroute_sim::bench::RequestClass> = classes.as_ref().map_or(Vec::new(), |c| {
        requests
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let (priority, tenant) = c.of(r, i, a.workload.seed);
                kvroute_sim::bench::RequestClass {
                    priority,
                    tenant,
                    ttft_objective_ms: c.objective_of(priority),
                }
            })
            .collect()
    });
    let rt = tokio::runtime::Runtime::new()?;
    let started = Instant::now();
    let (mut run, servers) = rt.block_on(kvroute_sim::bench::bench(
        &a.url,
        a.api,
        a.model.served_name(),
        &requests,
        &per_request,
        a.duration,
        &a.label,
        move |n| b.set_position(n),
    ))?;
    run.sim_wall_s = (started.elapsed().as_secs_f64() * 1000.0).round() / 1000.0;
    anyhow::ensure!(a.time_scale > 0.0, "--time-scale must be positive");
    run.scale_time(a.time_scale);
    bar.finish_and_clear();
    print!("{}", report::table(std::slice::from_ref(&run)));
    for (s, st) in servers.iter().zip(&run.per_server) {
        println!(
            "  {s}: {} requests ({:.1}%), hit rate {:.1}%",
            st.requests,
            st.share * 100.0,
            st.hit_rate * 100.0
        );
    }
    if !run.failures.is_empty() {
        let why: Vec<String> = run.failures.iter().map(|(c, n)| format!("{n} × {c}")).collect();
        println!("  failed: {}", why.join("; "));
    }
    let mut class_json = serde_json::Value::Null;
    if classes.is_some() {
        let span_s = requests
            .iter()
            .map(|r| r.arrival_ms)
            .filter(|at| *at <= a.duration * 1000.0)
            .fold(0.0, f64::max)
            / 1000.0;
        let (text, json) =
            kvroute_sim::overload::summary(&[vec![run.clone()]], a.classes.ttft_slo_ms, span_s.max(1e-3));
        print!("{text}");
        class_json = json;
    }
    if let Some(path) = &a.json {
        let mut doc = serde_json::json!({ "workload": name, "url": a.url, "servers": servers, "runs": [run] });
        if !class_json.is_null() {
            doc["classes"] = class_json;
        }
        std::fs::write(path, serde_json::to_string_pretty(&doc)? + "\n")
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    anyhow::ensure!(
        run.failed * 10 <= run.requests,
        "{} of {} requests failed",
        run.failed,
        run.requests
    );
    Ok(())
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
    /// Generators: groups (shared-prefix), conversations (multi-turn) or documents (rag).
    #[arg(long)]
    groups: Option<u64>,
    /// Generators: prompts per group, turns per conversation, or documents per query.
    #[arg(long)]
    per_group: Option<u64>,
    /// Generators: tokens of the shared system prompt.
    #[arg(long)]
    system_tokens: Option<u64>,
    /// Generators: tokens of each question / user turn.
    #[arg(long)]
    question_tokens: Option<u64>,
    /// Generators: output tokens per request.
    #[arg(long)]
    output_tokens: Option<u64>,
    /// Rag: the number of queries (default 8 per document), so that the working set
    /// (`--groups`) and the trace's length can be chosen apart.
    #[arg(long)]
    queries: Option<u64>,
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
                    TraceFormat::Capture => {
                        let (reqs, notes) = workload::parse_capture(&text, self.output_tokens.unwrap_or(128))?;
                        eprintln!("{}", workload::describe_capture(&notes));
                        reqs
                    }
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
                let set = |v: Option<u64>, field: &mut u64, name: &str| -> anyhow::Result<()> {
                    if let Some(v) = v {
                        anyhow::ensure!(v > 0, "--{name} must be at least 1");
                        *field = v;
                    }
                    Ok(())
                };
                set(self.groups, &mut p.groups, "groups")?;
                set(self.per_group, &mut p.prompts_per_group, "per-group")?;
                set(self.system_tokens, &mut p.system_tokens, "system-tokens")?;
                set(self.question_tokens, &mut p.question_tokens, "question-tokens")?;
                set(self.output_tokens, &mut p.output_tokens, "output-tokens")?;
                if let Some(n) = self.queries {
                    anyhow::ensure!(g == Generator::Rag, "--queries applies to --workload rag only (the other generators' length is --groups × --per-group)");
                    anyhow::ensure!(n > 0, "--queries must be at least 1");
                    p.queries = Some(n);
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
    /// A mixed fleet instead of --servers/--gpu/--model/--tp (replay, matrix and serve):
    /// `COUNTxGPU:MODEL[:tpN][:seqsN],...`, e.g. `4xh100-80g:llama-3.1-8b,4xa100-80g:llama-3.1-8b`;
    /// `seqsN` sets those servers' sequence slots (vLLM's `--max-num-seqs`).
    #[arg(long)]
    fleet: Option<String>,
    /// Blocks become prefix-cache hits when their step ends, not when it is planned as vLLM
    /// V1 caches them (the default): the engine of the figures published before 2026-11-28,
    /// where a request admitted beside a sibling computes the sibling's chunk again.
    #[arg(long)]
    cache_at_finish: bool,
    /// The default since 2026-11-28 (kept so that earlier commands still run).
    #[arg(long, hide = true, conflicts_with = "cache_at_finish")]
    cache_at_schedule: bool,
}

impl FleetArgs {
    fn cache_at_schedule(&self) -> bool {
        self.cache_at_schedule || !self.cache_at_finish
    }

    pub fn profile(&self) -> anyhow::Result<Profile> {
        anyhow::ensure!(self.servers >= 1, "--servers must be at least 1");
        Ok(Profile::new(self.gpu, self.model, self.tp)?.with_cache_at_schedule(self.cache_at_schedule()))
    }

    /// The first server's profile, the number of servers, and each server's profile when
    /// the fleet is mixed (`--fleet`).
    pub fn fleet(&self) -> anyhow::Result<(Profile, usize, Vec<Profile>)> {
        let Some(spec) = &self.fleet else {
            return Ok((self.profile()?, self.servers, Vec::new()));
        };
        let mixed: Vec<Profile> = kvroute_sim::profile::parse_fleet(spec)?
            .into_iter()
            .map(|p| p.with_cache_at_schedule(self.cache_at_schedule()))
            .collect();
        Ok((mixed[0].clone(), mixed.len(), mixed))
    }
}

/// The gateway topology the routers run in (see `replay::topology`).
#[derive(Args)]
pub struct TopologyArgs {
    /// Gateway replicas (Envoy processes), each with its own routers and scrapes.
    #[arg(long, default_value_t = 1)]
    gateways: usize,
    /// Envoy workers per replica, each an independent router.
    #[arg(long, default_value_t = 1)]
    workers: usize,
    /// Workers do not share placements and load (kvroute before one view per process).
    #[arg(long)]
    no_share: bool,
    /// The workers' tick (flushing and applying peer events and snapshots), in ms.
    #[arg(long, default_value_t = 10.0)]
    tick_ms: f64,
    /// Replicas exchange peer events too (a modelled cross-replica protocol).
    #[arg(long)]
    share_gateways: bool,
    /// With --share-gateways: ms from a replica's flush until the other replicas have its events.
    #[arg(long, default_value_t = 20.0)]
    gateway_delay_ms: f64,
    /// With --share-gateways: model the filter's forwarding (placements leave at once, at most
    /// one batch per ms; other events every this many ms) with --gateway-delay-ms as the hop.
    #[arg(long, default_value_t = 0.0)]
    gateway_interval_ms: f64,
    /// With --gateway-interval-ms: a worker's batch holding a placement that is news leaves
    /// for the other replicas when the worker writes it (the filter's
    /// `share.replicas.from_workers`), not at the scraping service's next tick.
    #[arg(long)]
    direct_placements: bool,
    /// With --direct-placements: the most POSTs one worker makes a second (the filter's
    /// `share.replicas.from_workers_per_s`); news past it waits for the service's batch.
    #[arg(long, default_value_t = 20.0)]
    direct_per_s: f64,
    /// Experiment: workers send at once only placements that are news; the rest every this
    /// many ms (0: everything at the tick).
    #[arg(long, default_value_t = 0.0)]
    news_flush_ms: f64,
    /// With --news-flush-ms: a placement also leaves at once when the worker's last batch
    /// left over two flush periods (+ 1 ms) before (the filter's `hits_on_tick`, a rate limit).
    #[arg(long)]
    hits_when_quiet: bool,
    /// Workers read their peers' events at most once per millisecond before a decision (the
    /// filter): an event reaching a worker that already read in that millisecond waits for
    /// the next one.
    #[arg(long)]
    read_once_per_ms: bool,
    /// The gateway restarts at this second of the run (an Envoy restart, a wasm reload):
    /// every router starts over with nothing learned while the fleet keeps running; only
    /// requests arriving from then on are reported (evictions and preemptions count the
    /// whole run). Must fall before the last arrival.
    #[arg(long)]
    restart_at_s: Option<f64>,
    /// Held requests (`overload.hold`) wait in one queue per worker instead of one per
    /// gateway (the filter's earlier design, to compare; the filter holds one per process).
    #[arg(long)]
    hold_per_worker: bool,
}

impl TopologyArgs {
    pub fn topology(&self) -> anyhow::Result<Topology> {
        anyhow::ensure!(
            (1..=64).contains(&self.gateways) && (1..=64).contains(&self.workers),
            "--gateways and --workers must be between 1 and 64"
        );
        anyhow::ensure!(self.tick_ms > 0.0, "--tick-ms must be positive");
        anyhow::ensure!(
            self.restart_at_s.is_none_or(|t| t.is_finite() && t >= 0.0),
            "--restart-at-s must be a number of seconds, not negative"
        );
        anyhow::ensure!(self.gateway_delay_ms >= 0.0, "--gateway-delay-ms must not be negative");
        anyhow::ensure!(
            self.gateway_interval_ms >= 0.0,
            "--gateway-interval-ms must not be negative"
        );
        anyhow::ensure!(self.direct_per_s >= 1.0, "--direct-per-s must be at least 1");
        Ok(Topology {
            gateways: self.gateways,
            workers: self.workers,
            share_workers: !self.no_share,
            tick_ms: self.tick_ms,
            share_gateways: self.share_gateways,
            gateway_delay_ms: self.gateway_delay_ms,
            gateway_interval_ms: self.gateway_interval_ms,
            direct_placements: self.direct_placements,
            direct_per_s: self.direct_per_s,
            news_flush_ms: self.news_flush_ms,
            hits_when_quiet: self.hits_when_quiet,
            read_once_per_ms: self.read_once_per_ms,
            restart_at_ms: self.restart_at_s.map(|s| s * 1000.0),
            hold_per_worker: self.hold_per_worker,
        })
    }
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Replay(a) => replay_cmd(&a),
        Command::Serve(a) => serve_cmd(&a),
        Command::Bench(a) => bench_cmd(&a),
        Command::Compare(a) => compare_cmd(&a),
        Command::Profiles => profiles_cmd(),
        Command::Matrix(a) => matrix_cmd(&a),
        Command::Plan(a) => plan_cmd(&a),
    }
}
