//! The `compare`, `profiles` and `matrix` subcommands.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use kvroute_sim::policies::PolicyName;
use kvroute_sim::profile::{Gpu, Model, Profile};
use kvroute_sim::replay::ReplaySetup;
use kvroute_sim::report::{self, RunReport};
use kvroute_sim::workload::{self, GenParams, Generator};

use crate::{FleetArgs, RouterArgs, TopologyArgs};

#[derive(Args)]
pub struct MatrixArgs {
    #[command(flatten)]
    fleet: FleetArgs,
    /// The traces directory (mooncake_synthetic.jsonl, azure_code_2023.csv).
    #[arg(long, default_value = "simulator/traces")]
    traces: PathBuf,
    /// Loads in percent of measured capacity.
    #[arg(long, value_delimiter = ',', default_value = "50,80,110")]
    loads: Vec<u32>,
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "round-robin,random,least-request,power-of-two,gie-weighted,sglang-cache-aware,dynamo-kv,kvroute,oracle"
    )]
    policy: Vec<PolicyName>,
    /// Workloads to include (shared-prefix, multi-turn, long-chat, rag, mooncake, azure;
    /// long-chat is multi-turn chat whose histories outgrow one server's cache).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "shared-prefix,multi-turn,long-chat,rag,mooncake,azure"
    )]
    workloads: Vec<String>,
    /// Azure: prefix overlay groups.
    #[arg(long, default_value_t = 32)]
    prefix_overlay: u64,
    /// Runs per cell: the workload as given plus perturbed copies (jittered arrivals);
    /// tables and verdicts use the medians.
    #[arg(long, default_value_t = 3)]
    replicas: u64,
    /// Also report each cell's steady state apart: the arrivals after this share of the
    /// cell's arrival span (e.g. 0.25; the rest is the cold start, while caches fill).
    #[arg(long)]
    steady_from: Option<f64>,
    #[command(flatten)]
    router: RouterArgs,
    #[arg(long)]
    json: Option<PathBuf>,
    #[arg(long)]
    markdown: Option<PathBuf>,
    /// With --json: every run also lists each completed request (server, arrival, TTFT,
    /// cached and reachable tokens, ...): large (about 300 MB for the full matrix on 9
    /// replicas).
    #[arg(long, requires = "json")]
    records: bool,
    #[command(flatten)]
    topology: TopologyArgs,
}

pub fn matrix_cmd(a: &MatrixArgs) -> anyhow::Result<()> {
    let router_config = a.router.config()?;
    let scrape_interval_ms = a.router.scrape_interval_ms()?;
    if let Some(f) = a.steady_from {
        anyhow::ensure!(
            f > 0.0 && f < 1.0,
            "--steady-from must be a share of the run between 0 and 1 (got {f})"
        );
    }
    let (profile, servers, mixed) = a.fleet.fleet()?;
    let setup = ReplaySetup {
        classes: None,
        pool_changes: Vec::new(),
        profile,
        servers,
        mixed,
        slowdown: None,
        scrape_interval_ms,
        seed: 0,
        router_config,
        topology: a.topology.topology()?,
    };
    const WORKLOADS: [&str; 6] = ["shared-prefix", "multi-turn", "long-chat", "rag", "mooncake", "azure"];
    if let Some(w) = a.workloads.iter().find(|w| !WORKLOADS.contains(&w.as_str())) {
        anyhow::bail!("unknown workload {w:?} ({})", WORKLOADS.join(", "));
    }
    let mut all = Vec::new();
    let mut capacities = Vec::new();
    for w in &a.workloads {
        let requests = match w.as_str() {
            "shared-prefix" => {
                workload::generate(Generator::SharedPrefix, &GenParams::defaults(Generator::SharedPrefix))
            }
            "multi-turn" => workload::generate(Generator::MultiTurn, &GenParams::defaults(Generator::MultiTurn)),
            "long-chat" => workload::generate(Generator::MultiTurn, &GenParams::long_chat()),
            "rag" => workload::generate(Generator::Rag, &GenParams::defaults(Generator::Rag)),
            "mooncake" => workload::parse_mooncake(
                &std::fs::read_to_string(a.traces.join("mooncake_synthetic.jsonl")).context("mooncake trace")?,
            )?,
            "azure" => workload::parse_azure(
                &std::fs::read_to_string(a.traces.join("azure_code_2023.csv")).context("azure trace")?,
                a.prefix_overlay,
                0,
            )?,
            other => unreachable!("{other:?} passed the check above"),
        };
        let started = Instant::now();
        let (cap, cells) = kvroute_sim::matrix::cells(
            &setup,
            w,
            &requests,
            &a.loads,
            &a.policy,
            a.replicas,
            a.steady_from,
            &|m| eprintln!("  {m}"),
        )?;
        eprintln!("{w}: done in {:.0} s", started.elapsed().as_secs_f64());
        capacities.push(serde_json::json!({"workload": w, "capacity_req_s": cap, "requests": requests.len()}));
        all.extend(cells);
    }
    let md = kvroute_sim::matrix::markdown(&all);
    print!("{md}");
    if let Some(p) = &a.markdown {
        std::fs::write(p, &md)?;
    }
    if let Some(p) = &a.json {
        let cells = kvroute_sim::matrix::json(&all, a.records)?;
        let doc = serde_json::json!({"servers": setup.servers, "capacities": capacities, "cells": cells});
        std::fs::write(p, serde_json::to_string_pretty(&doc)? + "\n")?;
    }
    Ok(())
}

pub fn profiles_cmd() -> anyhow::Result<()> {
    println!(
        "{:<16} {:<9} {:>3} {:>16} {:>18} {:>15} {:>10}",
        "model", "gpu", "tp", "decode b=1 (ms)", "8k prefill (ms)", "prefill tok/s", "KV blocks"
    );
    for (model, gpu, tp) in [
        (Model::Llama31_8b, Gpu::H100_80g, 1),
        (Model::Llama31_8b, Gpu::A100_80g, 1),
        (Model::Llama31_70b, Gpu::H100_80g, 4),
        (Model::Llama31_70b, Gpu::A100_80g, 8),
    ] {
        let p = Profile::new(gpu, model, tp)?;
        let rate = p.prefill_tokens_per_s(8192);
        println!(
            "{:<16} {:<9} {:>3} {:>16.2} {:>18.1} {:>15.0} {:>10}",
            format!("{model:?}"),
            format!("{gpu:?}"),
            tp,
            p.step_ms(1, 1000.0, 1000),
            8192.0 / rate * 1000.0,
            rate,
            p.num_gpu_blocks
        );
    }
    Ok(())
}

#[derive(Args)]
pub struct CompareArgs {
    /// JSON files written by `replay --json` or `bench --json`.
    files: Vec<PathBuf>,
    #[arg(long)]
    plot: Option<PathBuf>,
    #[arg(long, default_value = "comparison")]
    title: String,
}

pub fn compare_cmd(a: &CompareArgs) -> anyhow::Result<()> {
    let mut runs: Vec<RunReport> = Vec::new();
    for f in &a.files {
        let doc: serde_json::Value =
            serde_json::from_slice(&std::fs::read(f).with_context(|| format!("cannot read {}", f.display()))?)
                .with_context(|| format!("{} is not JSON", f.display()))?;
        let file_runs: Vec<RunReport> =
            serde_json::from_value(doc["runs"].clone()).with_context(|| format!("{}: no runs", f.display()))?;
        runs.extend(file_runs);
    }
    anyhow::ensure!(!runs.is_empty(), "no runs to compare");
    print!("{}", report::table(&runs));
    if let [first, .., last] = runs.as_slice() {
        let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
        println!(
            "{} vs {}: TTFT p50 {:.2}x lower, p95 {:.2}x lower, p99 {:.2}x lower; output throughput {:.2}x; prefix hit rate {:.1}% vs {:.1}%",
            first.policy,
            last.policy,
            ratio(last.ttft_ms.p50, first.ttft_ms.p50),
            ratio(last.ttft_ms.p95, first.ttft_ms.p95),
            ratio(last.ttft_ms.p99, first.ttft_ms.p99),
            ratio(first.throughput.output_tok_s, last.throughput.output_tok_s),
            first.prefix_hit_rate * 100.0,
            last.prefix_hit_rate * 100.0
        );
    }
    for r in &runs {
        let shares: Vec<String> = r
            .per_server
            .iter()
            .map(|s| format!("{:.0}%", s.share * 100.0))
            .collect();
        println!("  {:<14} per-server share: {}", r.policy, shares.join(" "));
    }
    if let Some(path) = &a.plot {
        std::fs::write(path, report::svg(&a.title, &runs))
            .with_context(|| format!("cannot write {}", path.display()))?;
        println!("report: {}", path.display());
    }
    Ok(())
}
