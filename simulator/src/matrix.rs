//! The routing-quality matrix: workloads × loads × policies on one fleet, in replay.
//!
//! Load is relative to a measured capacity: the rate at which the fleet starts serving
//! requests when the whole workload arrives at once under `least-request` (a cache-unaware
//! balancer): requests / (time of the last first token). With every arrival at t = 0 the
//! fleet is saturated until it has admitted the last request, so this is its saturated
//! service rate, without the decode tail that the last requests add to the makespan. A load
//! of 80% replays the workload with arrival times scaled to a mean rate of 0.8 × capacity.

use std::fmt::Write;

use crate::policies::PolicyName;
use crate::replay::{run, ReplaySetup};
use crate::report::RunReport;
use crate::workload::SimRequest;

#[derive(Clone, Debug, serde::Serialize)]
pub struct Cell {
    pub workload: String,
    pub load_pct: u32,
    pub arrival_rate: f64,
    pub runs: Vec<RunReport>,
}

/// Requests per second the fleet admits with everything offered at t = 0.
pub fn capacity(setup: &ReplaySetup, requests: &[SimRequest]) -> f64 {
    let burst: Vec<SimRequest> = requests
        .iter()
        .map(|r| SimRequest {
            arrival_ms: 0.0,
            ..r.clone()
        })
        .collect();
    let r = run(setup, PolicyName::LeastRequest, &burst, &|_| {});
    let last_first_token_s = r.ttft_cdf_ms.last().copied().unwrap_or(0.0) / 1000.0;
    r.completed as f64 / last_first_token_s.max(1e-9)
}

/// The workload re-timed to a mean arrival rate of `rate` requests per second.
pub fn at_rate(requests: &[SimRequest], rate: f64) -> Vec<SimRequest> {
    let span_s = requests.iter().map(|r| r.arrival_ms).fold(0.0, f64::max) / 1000.0;
    let offered = requests.len() as f64 / span_s.max(1e-9);
    let k = offered / rate;
    requests
        .iter()
        .map(|r| SimRequest {
            arrival_ms: r.arrival_ms * k,
            ..r.clone()
        })
        .collect()
}

/// One workload's cells, `progress` told each finished run.
pub fn cells(
    setup: &ReplaySetup,
    name: &str,
    requests: &[SimRequest],
    loads: &[u32],
    policies: &[PolicyName],
    progress: &dyn Fn(&str),
) -> (f64, Vec<Cell>) {
    let cap = capacity(setup, requests);
    progress(&format!("{name}: capacity {cap:.2} req/s"));
    let mut out = Vec::new();
    for load in loads {
        let rate = cap * f64::from(*load) / 100.0;
        let reqs = at_rate(requests, rate);
        let mut runs = Vec::new();
        for p in policies {
            runs.push(run(setup, *p, &reqs, &|_| {}));
            progress(&format!("{name} {load}% {p}"));
        }
        out.push(Cell {
            workload: name.to_string(),
            load_pct: *load,
            arrival_rate: rate,
            runs,
        });
    }
    (cap, out)
}

/// Markdown: per cell, every policy's TTFT p50/p95/p99, throughput and hit rate, and
/// whether kvroute met the goals (p95 and output throughput at least as good as every
/// non-oracle baseline; hit rate within 10% of the oracle's).
pub fn markdown(cells: &[Cell]) -> String {
    let mut s = String::new();
    for c in cells {
        let _ = writeln!(
            s,
            "\n#### {} at {}% load ({:.2} req/s)\n",
            c.workload, c.load_pct, c.arrival_rate
        );
        let _ = writeln!(
            s,
            "| policy | TTFT p50 | TTFT p95 | TTFT p99 | out tok/s | req/s | prefix hit | preemptions |"
        );
        let _ = writeln!(s, "|---|---|---|---|---|---|---|---|");
        for r in &c.runs {
            let bold = if r.policy == "kvroute" { "**" } else { "" };
            let _ = writeln!(
                s,
                "| {bold}{}{bold} | {:.0} | {:.0} | {:.0} | {:.0} | {:.2} | {:.1}% | {} |",
                r.policy,
                r.ttft_ms.p50,
                r.ttft_ms.p95,
                r.ttft_ms.p99,
                r.throughput.output_tok_s,
                r.throughput.req_s,
                r.prefix_hit_rate * 100.0,
                r.preemptions
            );
        }
        let _ = writeln!(s, "\n{}", verdict(c));
    }
    s
}

/// The goals of the routing benchmark, checked for one cell.
pub fn verdict(c: &Cell) -> String {
    let Some(kv) = c.runs.iter().find(|r| r.policy == "kvroute") else {
        return String::new();
    };
    let others: Vec<&RunReport> = c
        .runs
        .iter()
        .filter(|r| r.policy != "kvroute" && r.policy != "oracle")
        .collect();
    let best_p95 = others.iter().map(|r| r.ttft_ms.p95).fold(f64::MAX, f64::min);
    let best_tput = others.iter().map(|r| r.throughput.output_tok_s).fold(0.0, f64::max);
    let mut notes = Vec::new();
    let p95_ok = kv.ttft_ms.p95 <= best_p95 * 1.0001;
    notes.push(if p95_ok {
        format!("TTFT p95 best of the non-oracle policies ({:.0} ms)", kv.ttft_ms.p95)
    } else {
        let who = others
            .iter()
            .filter(|r| r.ttft_ms.p95 < kv.ttft_ms.p95)
            .map(|r| r.policy.as_str())
            .collect::<Vec<_>>()
            .join(", ");
        format!(
            "**missed**: TTFT p95 {:.0} ms vs {:.0} ms (beaten by {who})",
            kv.ttft_ms.p95, best_p95
        )
    });
    // Throughput: within 1% counts as equal (the workload is the same; small differences are
    // the drain of the last requests).
    notes.push(if kv.throughput.output_tok_s >= best_tput * 0.99 {
        "throughput at least as good (within 1%)".to_string()
    } else {
        format!(
            "**missed**: throughput {:.0} vs {:.0} tok/s",
            kv.throughput.output_tok_s, best_tput
        )
    });
    if let Some(o) = c.runs.iter().find(|r| r.policy == "oracle") {
        let ok = kv.prefix_hit_rate >= o.prefix_hit_rate * 0.9;
        notes.push(format!(
            "{}hit rate {:.1}% vs oracle {:.1}%",
            if ok { "" } else { "**missed**: " },
            kv.prefix_hit_rate * 100.0,
            o.prefix_hit_rate * 100.0
        ));
    }
    if let Some(rr) = c.runs.iter().find(|r| r.policy == "round-robin") {
        notes.push(format!(
            "TTFT p95 {:.1}× lower than round-robin",
            rr.ttft_ms.p95 / kv.ttft_ms.p95.max(1e-9)
        ));
    }
    format!("kvroute: {}.", notes.join("; "))
}
