//! What a replayed fleet costs per million tokens at given GPU prices, next to how many
//! requests met the TTFT objective and which GPUs served them (`replay --price`).
//!
//! The fleet is paid for by the hour whether a server is busy or idle (reserved or
//! on-demand instances), so a run's cost per token is the fleet's price per hour over the
//! input and output tokens it served per hour over the run's span. Every server is billed
//! for the whole span, also one that joins or leaves the pool mid-run (`--join`,
//! `--leave`): such a run's cost is the fleet's at its largest. Two routings of one
//! fleet at one load therefore differ in cost only through what they complete; where the
//! work lands shows in the share of requests each GPU type served, and in the objective.

use std::collections::BTreeMap;
use std::fmt::Write;

use serde::Serialize;

use super::RunReport;
use crate::matrix::median;
use crate::plan::{gpu_name, Prices};
use crate::profile::Profile;

/// One run (or the median of several) in money and in the objective.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RunCost {
    pub policy: String,
    /// USD per million tokens served (input + output).
    pub usd_per_mtok: f64,
    /// Share of the requests offered whose first token came within the objective; a request
    /// that failed or was refused (429) misses it.
    pub objective_met: f64,
    /// Each GPU type's share of the completed requests (`h100-80g` → 0.6).
    pub share_by_gpu: BTreeMap<String, f64>,
}

/// The fleet's USD per hour: every server's GPUs (its tensor-parallel size) at its GPU's price.
pub fn fleet_usd_per_hour(servers: &[Profile], prices: &Prices) -> f64 {
    servers.iter().map(|p| p.tp as f64 * prices.of(p.gpu)).sum()
}

/// `run` on `servers` (one profile per server, in server order) at `prices`, against a TTFT
/// objective of `ttft_objective_ms` (a request that sent its own, `--objectives`, against
/// that).
pub fn run_cost(run: &RunReport, servers: &[Profile], prices: &Prices, ttft_objective_ms: f64) -> RunCost {
    let tokens_per_hour = (run.throughput.input_tok_s + run.throughput.output_tok_s) * 3600.0;
    let usd_per_mtok = if tokens_per_hour > 0.0 {
        fleet_usd_per_hour(servers, prices) / (tokens_per_hour / 1e6)
    } else {
        f64::INFINITY
    };
    let met = run
        .records
        .iter()
        .filter(|r| r.ttft_ms <= r.ttft_objective_ms.unwrap_or(ttft_objective_ms))
        .count();
    let mut share_by_gpu: BTreeMap<String, f64> = servers.iter().map(|p| (gpu_name(p.gpu), 0.0)).collect();
    let completed = run.records.len().max(1) as f64;
    for r in &run.records {
        if let Some(p) = servers.get(r.server) {
            *share_by_gpu.entry(gpu_name(p.gpu)).or_default() += 1.0 / completed;
        }
    }
    RunCost {
        policy: run.policy.clone(),
        usd_per_mtok,
        objective_met: met as f64 / run.requests.max(1) as f64,
        share_by_gpu,
    }
}

/// Each figure's median over `runs` (one policy's replicas; not empty).
pub fn median_cost(runs: &[RunCost]) -> RunCost {
    debug_assert!(!runs.is_empty(), "a median of no runs");
    let first = runs[0].clone();
    let share_by_gpu = first
        .share_by_gpu
        .keys()
        .map(|gpu| {
            let shares = runs
                .iter()
                .map(|r| r.share_by_gpu.get(gpu).copied().unwrap_or(0.0))
                .collect();
            (gpu.clone(), median(shares))
        })
        .collect();
    RunCost {
        usd_per_mtok: median(runs.iter().map(|r| r.usd_per_mtok).collect()),
        objective_met: median(runs.iter().map(|r| r.objective_met).collect()),
        share_by_gpu,
        ..first
    }
}

/// The lines `replay --price` prints under the latency table.
pub fn table(costs: &[RunCost], prices: &Prices, fleet_usd_per_hour: f64, ttft_objective_ms: f64) -> String {
    let in_fleet = |gpu: &str| costs.iter().any(|c| c.share_by_gpu.contains_key(gpu));
    let priced: Vec<String> = prices
        .iter()
        .map(|(g, p)| (gpu_name(*g), p))
        .filter(|(g, _)| in_fleet(g))
        .map(|(g, p)| format!("{g} at ${p:.2}"))
        .collect();
    let mut out = format!(
        "cost: {} per GPU-hour, the fleet {:.2} USD an hour, paid whether busy or idle; objective: TTFT ≤ {} ms (or a request's own)\n",
        priced.join(", "),
        fleet_usd_per_hour,
        ttft_objective_ms
    );
    let _ = writeln!(
        out,
        "{:<19} {:>12} {:>14}  requests by GPU",
        "policy", "$/Mtok", "met objective"
    );
    for c in costs {
        let shares: Vec<String> = c
            .share_by_gpu
            .iter()
            .map(|(gpu, s)| format!("{gpu} {:.1}%", 100.0 * s))
            .collect();
        let _ = writeln!(
            out,
            "{:<19} {:>12.4} {:>13.1}%  {}",
            c.policy,
            c.usd_per_mtok,
            100.0 * c.objective_met,
            shares.join(", ")
        );
    }
    let _ = writeln!(out, "($/Mtok: USD per million input + output tokens served)");
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::{Gpu, Model};
    use crate::report::{Record, Throughput};

    fn profile(gpu: Gpu, tp: u32) -> Profile {
        Profile::new(gpu, Model::Llama31_8b, tp).unwrap()
    }

    fn record(server: usize, ttft_ms: f64) -> Record {
        Record {
            server,
            ttft_ms,
            ..Record::default()
        }
    }

    #[test]
    fn a_fleet_costs_its_servers_gpus_at_their_prices_over_the_tokens_it_served() {
        let prices = Prices::parse("h100-80g=3,a100-80g=1.5", &[]).unwrap();
        let servers = [profile(Gpu::A100_80g, 1), profile(Gpu::H100_80g, 2)];
        assert_eq!(fleet_usd_per_hour(&servers, &prices), 1.5 + 2.0 * 3.0);
        let run = RunReport {
            policy: "kvroute".into(),
            requests: 4,
            throughput: Throughput {
                input_tok_s: 900.0,
                output_tok_s: 100.0,
                ..Throughput::default()
            },
            records: vec![record(0, 100.0), record(1, 400.0), record(1, 600.0)],
            ..RunReport::default()
        };
        let c = run_cost(&run, &servers, &prices, 500.0);
        // 7.5 USD an hour over 3.6 million tokens an hour.
        assert!((c.usd_per_mtok - 7.5 / 3.6).abs() < 1e-9, "{}", c.usd_per_mtok);
        // Two of the four offered met 500 ms: the fourth never completed.
        assert_eq!(c.objective_met, 0.5);
        assert!((c.share_by_gpu["a100-80g"] - 1.0 / 3.0).abs() < 1e-9);
        assert!((c.share_by_gpu["h100-80g"] - 2.0 / 3.0).abs() < 1e-9);
    }

    #[test]
    fn a_gpu_type_that_served_nothing_is_listed_at_zero_and_a_run_without_tokens_costs_infinity() {
        let prices = Prices::parse("h100-80g=3,a100-80g=1.5", &[]).unwrap();
        let servers = [profile(Gpu::A100_80g, 1), profile(Gpu::H100_80g, 1)];
        let run = RunReport {
            policy: "round-robin".into(),
            requests: 1,
            ..RunReport::default()
        };
        let c = run_cost(&run, &servers, &prices, 500.0);
        assert_eq!(c.share_by_gpu["a100-80g"], 0.0);
        assert_eq!(c.share_by_gpu["h100-80g"], 0.0);
        assert!(c.usd_per_mtok.is_infinite());
        assert_eq!(c.objective_met, 0.0);
    }

    #[test]
    fn the_median_of_replicas_takes_each_figure_apart() {
        let c = |usd: f64, met: f64, h100: f64| RunCost {
            policy: "kvroute".into(),
            usd_per_mtok: usd,
            objective_met: met,
            share_by_gpu: [("h100-80g".to_string(), h100)].into_iter().collect(),
        };
        let m = median_cost(&[c(0.05, 0.99, 0.2), c(0.03, 0.90, 0.9), c(0.04, 0.95, 0.5)]);
        assert_eq!(m, c(0.04, 0.95, 0.5));
    }
}
